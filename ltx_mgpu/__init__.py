"""ltx_mgpu: multi-GPU LTX-2 inference engine (no Redis, RQ or S3 here).

Public API:
- `MGPUController`, `Stream`: the persistent one-job-at-a-time fleet (see `controller.py` for the contract).
- `MGPURunner`, `ProcessGroups`, `RankContext`: what a pipeline implements and what it is given.
- Errors: `RunnerError`, `JobCancelled`, `SymmetricRunnerError`, `JobCancelledError`,
  `AsymmetricRunnerError`, `ControllerBusyError`, `FleetFailure`, `FleetTimeoutError`.
- `parse_device_group`: "0,1,2,3" / "cpu:2" → a device list.
"""

from .controller import MGPUController, Stream
from .devices import parse_device_group
from .errors import (
    AsymmetricRunnerError,
    ControllerBusyError,
    FleetFailure,
    FleetTimeoutError,
    JobCancelled,
    JobCancelledError,
    RunnerError,
    SymmetricRunnerError,
)
from .runner import MGPURunner, ProcessGroups, RankContext

__all__ = [
    "AsymmetricRunnerError",
    "ControllerBusyError",
    "FleetFailure",
    "FleetTimeoutError",
    "JobCancelled",
    "JobCancelledError",
    "MGPUController",
    "MGPURunner",
    "ProcessGroups",
    "RankContext",
    "RunnerError",
    "Stream",
    "SymmetricRunnerError",
    "parse_device_group",
]
