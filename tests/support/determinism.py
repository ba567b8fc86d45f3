"""A probe of the deterministic switches every rank of a fleet sets (`ltx_mgpu.control.determinism`), shared by
the CPU and GPU determinism tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from ltx_mgpu import MGPURunner

__all__ = ["ON_SWITCHES", "SwitchProbe", "probe_ranks", "rank_switches"]


class SwitchProbe(MGPURunner):
    """Reports, from every rank, the deterministic switches its process had when the runner was built (after
    the fleet bound the device, before `setup()` and any job) and when a job runs. Used by
    tests/test_determinism.py (CPU ranks) and tests/test_determinism_gpu.py (CUDA devices)."""

    def __init__(self) -> None:
        self.at_init = rank_switches()

    def setup(self) -> None:
        pass

    def __call__(self) -> Iterator[dict[str, Any]]:
        yield {"rank": self.rank, "at_init": self.at_init, "in_job": rank_switches()}


def rank_switches() -> dict[str, Any]:
    """This process's deterministic switches (`determinism.apply`)."""
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


ON_SWITCHES = {"algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False, "cublas": ":4096:8"}


def probe_ranks(devices: list[Any], mode: str | None) -> tuple[str, list[dict[str, Any]]]:
    """A `SwitchProbe` fleet on `devices` in `mode` (None: the default): its resolved mode and every rank's
    report, by rank."""
    from ltx_mgpu import MGPUController

    ctl = MGPUController(SwitchProbe, devices=devices, deterministic=mode)
    ctl.start(timeout=300)
    try:
        reports = [e for e in ctl.stream(timeout=120) if isinstance(e, dict) and "rank" in e]
    finally:
        ctl.shutdown(graceful_timeout=10)
    return ctl.deterministic, sorted(reports, key=lambda r: r["rank"])
