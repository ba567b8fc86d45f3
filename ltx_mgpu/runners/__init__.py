"""Runners: `MGPURunner` implementations (pipelines) the controller runs on a fleet.

- `ltx_mgpu.runners.smoke.SmokeRunner`: the tiny LTX-2 smoke render (no real weights needed).

Import runners by module path; nothing here imports them eagerly (the control plane never imports
runners, and services choose them by name from their own settings).
"""
