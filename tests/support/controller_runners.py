"""Runners used by the controller tests. They live under tests/ on purpose: the controller must ship
runner classes by value, so classes defined outside an installed package still work after spawn."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ltx_mgpu import MGPURunner, RunnerError


class ImportingRunner(MGPURunner):
    """Declares a slow import plus one that does not exist; its setup "loads weights" first, then waits for
    the side thread and reports (as setup phases) which thread imported the probe and when."""

    background_imports = ("tests.support.slow_import_probe", "tests.no_such_module_here")

    def setup(self, *, load_s: float = 0.8) -> None:
        began = time.time()
        time.sleep(load_s)  # the weight load the import overlaps with
        self.await_background_imports()
        import tests.support.slow_import_probe as probe

        self.setup_phases_s = {
            "on_side_thread": float(probe.IMPORTED_BY == "ltx-mgpu-imports"),
            "imported_after_setup_began_s": probe.IMPORTED_AT - began,
        }

    def __call__(self) -> Iterator[Any]:
        yield self.rank


class ScriptedRunner(MGPURunner):
    """Does what the job's `mode` says, so one warm fleet can exercise every contract."""

    def setup(
        self,
        *,
        scale: float = 1.0,
        crash_on_rank: int | None = None,
        hang_on_rank: int | None = None,
        sleep_s: float = 0.0,
    ) -> None:
        time.sleep(sleep_s)  # stands in for a model load
        if crash_on_rank == self.rank:
            raise RuntimeError(f"setup exploded on rank {self.rank}")
        if hang_on_rank == self.rank:
            time.sleep(3600)
        self.scale = scale

    def __call__(
        self,
        *,
        mode: str = "ok",
        n: int = 2,
        x: torch.Tensor | None = None,
        nested: dict[str, Any] | None = None,
        target_rank: int = 1,
        sleep_s: float = 0.0,
        marker: str | None = None,
        env: list[str] | None = None,
        error: str = "oom",
        raise_on: list[int] | None = None,
        hog_mb: int = 64,
    ) -> Iterator[Any]:
        if mode == "env":
            yield {"rank": self.rank, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in env or ()}}
            return None
        if mode == "ok":
            for i in range(n):
                yield {"rank": self.rank, "i": i}
            return self.rank * 10
        if mode == "tensors":
            # Reduce across ranks so the test proves every rank got the same values on its own device.
            assert x is not None and nested is not None
            total = x.to(torch.float64).sum().reshape(1)
            if self.world_size > 1:
                dist.all_reduce(total, group=self.groups.transformer_group)
            yield {
                "rank": self.rank,
                "device": str(x.device),
                "x_sum_all_ranks": float(total.item()),
                "nested_sum": float(nested["t"].sum().item()),
                "scaled": x * self.scale,
            }
            return None
        if mode == "runner_error":
            raise RunnerError(f"bad input on rank {self.rank}")
        if mode == "value_error":
            raise ValueError("width must be positive")
        if mode == "asymmetric":
            if self.rank == target_rank:
                raise RunnerError("only one rank objects")
            yield "fine"
            return None
        if mode == "crash":  # a fleet-level fault (sticky CUDA error text): the rank exits
            yield "before"
            if self.rank == target_rank:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            time.sleep(30)
            return None
        if mode == "raise":  # an unexpected error in a render, on `raise_on` ranks (all when None)
            yield "before"
            if raise_on is None or self.rank in raise_on:
                raise _INJECTED[error](f"injected {error} on rank {self.rank}")
            if self.world_size > 1 and n:  # the others enter a collective the raising ranks never reach (n=0: not)
                dist.all_reduce(torch.ones(1), group=self.groups.transformer_group)
            return self.rank
        if mode == "alloc":  # a real allocation failure (CPU: torch raises RuntimeError, not OutOfMemoryError)
            yield "before"
            held = torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB
            yield held.numel()
            return None
        if mode == "hog":  # holds memory in its frame, then runs out of it: the next job must get it back
            held = torch.ones(hog_mb << 18)  # (float32: hog_mb MiB)
            yield {"rank": self.rank, "held": held.numel()}
            time.sleep(sleep_s)  # (the test reads the rank's memory use meanwhile)
            raise torch.OutOfMemoryError(f"injected: tried to allocate more on rank {self.rank}")
        if mode == "exit":
            if self.rank == target_rank:
                if marker:
                    with open(marker, "w") as fh:
                        fh.write(repr(time.time()))
                os._exit(7)
            time.sleep(30)
            return None
        if mode == "sleep":
            time.sleep(sleep_s)
            yield "slept"
            return None
        if mode == "cancellable":
            for step in range(n):
                self.raise_if_cancelled()
                yield {"step": step, "rank": self.rank}
                time.sleep(sleep_s)
            return "completed"
        if mode == "not_generator":
            return None
        raise RunnerError(f"unknown mode {mode}")


#: what `mode="raise"` raises, by name
_INJECTED: dict[str, type[BaseException]] = {
    "oom": torch.OutOfMemoryError,
    "type": TypeError,
    "runtime": RuntimeError,
    "overflow": OverflowError,
}


class NotAGeneratorRunner(MGPURunner):
    def setup(self) -> None:
        pass

    def __call__(self) -> Any:
        return 42
