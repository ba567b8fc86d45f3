"""Run an `MGPURunner` in the calling process as a world of one (no controller, no child processes).

For debugging a pipeline, for single-GPU deployments that want no fleet, and for tests that check a runner
on one process. The runner gets the same context a fleet rank gets (device, per-component groups over a
world-1 gloo group), so its collectives run unchanged. Creates the default process group when none exists
and destroys it again on `close()`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...control.runner import MGPURunner, ProcessGroups, RankContext

__all__ = ["LocalRunner"]


class LocalRunner:
    """`LocalRunner(RunnerClass, device="cpu").start(**setup_kwargs)`; `run(**job_kwargs)` -> list of yields."""

    def __init__(self, runner_cls: type[MGPURunner], *, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._owns_group = False
        if not dist.is_initialized():
            # a world of one needs no port: an in-process store (no race for a free port)
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
            )
            self._owns_group = True
        if dist.get_world_size() != 1:
            raise RuntimeError("LocalRunner needs a world of one (a process group of size 1 or none)")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.runner = runner_cls()
        self.runner._groups = ProcessGroups(
            gemma_group=dist.group.WORLD,
            transformer_group=dist.group.WORLD,
            vae_group=dist.group.WORLD,
            control_group=dist.group.WORLD,
        )
        self.runner._ctx = RankContext(0, 1, self.device, "gloo")

    def start(self, **setup_kwargs: Any) -> LocalRunner:
        self.runner.setup(**setup_kwargs)
        return self

    def stream(self, **job_kwargs: Any) -> Iterator[Any]:
        return iter(self.runner(**job_kwargs))

    def run(self, **job_kwargs: Any) -> list[Any]:
        return list(self.stream(**job_kwargs))

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> LocalRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
