"""ltx_mgpu: multi-GPU LTX-2 inference engine (no Redis, RQ or S3 here).

Public API:
- `MGPUController`, `Stream`: the persistent one-job-at-a-time fleet (see `controller.py` for the contract).
- `MGPURunner`, `ProcessGroups`, `RankContext`: what a pipeline implements and what it is given.
- Errors, each an `LtxMgpuError` (the engine's one root): `RunnerError`, `RenderFault`, `RenderOutOfMemory`,
  `RunnerCancelled`, `SymmetricRunnerError`, `JobCancelledError`, `AsymmetricRunnerError`, `ControllerBusyError`,
  `FleetFailure`, `FleetTimeoutError`.
- `parse_device_group`, `canonical_group`: "0,1,2,3" / "cpu:2" → a device list / its canonical spec.

Names load lazily (PEP 562): `import ltx_mgpu` and `import ltx_mgpu.control.devices` import no torch, so the
worker's settings and supervisor can use the device-group parser without paying for (or needing) torch.
Torch comes in when the controller or a runner is first touched.
`tests/test_import_contracts.py` holds this and the other layering rules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .control.controller import MGPUController
    from .control.devices import canonical_group, parse_device_group
    from .control.errors import (
        AsymmetricRunnerError,
        ControllerBusyError,
        FleetFailure,
        FleetTimeoutError,
        JobCancelledError,
        RenderFault,
        RenderOutOfMemory,
        RunnerCancelled,
        RunnerError,
        SymmetricRunnerError,
    )
    from .control.runner import MGPURunner, ProcessGroups, RankContext
    from .control.stream import Stream
    from .errors import LtxMgpuError

#: public name → the submodule that defines it
_EXPORTS: dict[str, str] = {
    "MGPUController": "control.controller",
    "Stream": "control.stream",
    "canonical_group": "control.devices",
    "parse_device_group": "control.devices",
    "AsymmetricRunnerError": "control.errors",
    "ControllerBusyError": "control.errors",
    "FleetFailure": "control.errors",
    "FleetTimeoutError": "control.errors",
    "JobCancelledError": "control.errors",
    "RenderFault": "control.errors",
    "RenderOutOfMemory": "control.errors",
    "RunnerCancelled": "control.errors",
    "RunnerError": "control.errors",
    "SymmetricRunnerError": "control.errors",
    "LtxMgpuError": "errors",
    "MGPURunner": "control.runner",
    "ProcessGroups": "control.runner",
    "RankContext": "control.runner",
}

__all__ = [
    "AsymmetricRunnerError",
    "ControllerBusyError",
    "FleetFailure",
    "FleetTimeoutError",
    "JobCancelledError",
    "LtxMgpuError",
    "MGPUController",
    "MGPURunner",
    "ProcessGroups",
    "RankContext",
    "RenderFault",
    "RenderOutOfMemory",
    "RunnerCancelled",
    "RunnerError",
    "Stream",
    "SymmetricRunnerError",
    "canonical_group",
    "parse_device_group",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
