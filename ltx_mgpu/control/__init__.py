"""The engine's control plane: the persistent fleet and what crosses between the driver and its ranks.

`controller` (the `MGPUController` a service holds), `fleet` (each rank's process: boot, job loop, error
semantics), `runner` (the contract a model pipeline implements), `transport` (driver <-> rank channels),
`job_board` (cancellation), `startup` (timed fleet start), `events`, `errors`, `devices`.

It is model-agnostic and knows nothing of the data plane: no module here names `ltx_mgpu.parallel` or
`ltx_mgpu.runners`, not even lazily (`tests/test_control_plane_contract.py`); those depend on this folder,
never the other way. Importing this package (and `devices`) imports no torch.
"""
