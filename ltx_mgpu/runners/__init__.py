"""Runners: `MGPURunner` implementations (pipelines) the controller runs on a fleet.

- `ltx_mgpu.runners.smoke.SmokeRunner`: the tiny LTX-2 smoke render (no real weights needed).
- `ltx_mgpu.runners.noop.NoopRunner`: renders nothing (random bytes, real event shapes) to measure or
  smoke-test the service around the fleet.
- `ltx_mgpu.runners.ltx2.runners`: `Ltx2DistilledRunner`, `Ltx2TwoStageRunner` on LTX-2 checkpoints.
- `ltx_mgpu.runners.common`: what both families share (job arguments, the video hand-off, audio decoding,
  stage clock, loading checks, synthetic weights, `LocalRunner`).

Import runners by module path; nothing here imports them eagerly (the control plane never imports
runners, and services choose them by name from their own settings).
"""
