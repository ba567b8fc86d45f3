"""The warm-up of a new fleet: each configured request rendered once, on the plan a client job of its size gets.

`WarmUp.run(controller)` runs after every fleet start, before the first job (`worker.render.fleet.WarmFleet`).
The fleet reports the memory its devices offer once `setup()` returned (`FleetStartup.device_memory_bytes`),
so the warm-up is planned like any job: `plans(kwargs)` (the render service's, `RenderService.warmup_plans`)
returns the runner's `memory_plan` kwargs for that size, the first a client job gets, then each strictly
lower one. Outcomes per request:

| situation                                        | outcome                                                      |
|--------------------------------------------------|--------------------------------------------------------------|
| it renders                                       | warmed up                                                    |
| the plan refuses the size on these devices       | dropped (`refused`), nothing sent to the fleet               |
| out of memory, a lower-memory plan exists        | retried once with it, on the same fleet                      |
| out of memory on the lower-memory plan (or on    | dropped (`out_of_memory`)                                    |
| the lowest one)                                  |                                                              |
| any other error, or the fleet died               | raised: a failed build (`WarmFleet.start` rebuilds)          |

A dropped request logs one warning, emits a fleet event `warmup_dropped` (the worker counts it in
`ltx_worker_warmup_dropped_total{reason}`) and stays dropped for this process's later rebuilds: the worker
stays up and serves what fits. An out-of-memory error never discards the fleet (the ranks freed what the job
held before they reported it: `ltx_mgpu.RenderOutOfMemory`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ltx_contract.states import EventType
from worker.errors import WorkerError

__all__ = ["PlanFn", "WarmUp", "WarmupRefused", "is_out_of_memory"]

log = logging.getLogger("worker.render.warmup")

#: kwargs -> the `memory_plan` kwargs to try, first to lowest (`None`: the runner's default, no kwarg sent)
PlanFn = Callable[[dict[str, Any]], list[dict[str, Any] | None]]


class WarmupRefused(WorkerError):
    """The memory plan refuses this warm-up size on this fleet (the message says why and what fits)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A job that ended because its ranks ran out of memory and freed it (every rank, or the driver alone in a
    driver-only stage): the fleet is intact. Imports the engine lazily (this module loads without torch)."""
    from ltx_mgpu import AsymmetricRunnerError, RenderOutOfMemory, SymmetricRunnerError

    if isinstance(exc, SymmetricRunnerError):
        return exc.out_of_memory
    if isinstance(exc, AsymmetricRunnerError):
        return any(isinstance(t, RenderOutOfMemory) for t in getattr(exc, "terminals", ()))
    return False


class WarmUp:
    """The configured warm-up requests of one fleet; see the module docstring."""

    def __init__(
        self,
        requests: Sequence[dict[str, Any]],
        *,
        directory: Path | None,
        timeout: float,
        on_event: Callable[[dict[str, Any]], None],
    ) -> None:
        self.requests = [dict(kwargs) for kwargs in requests]  #: job kwargs (no output_path, no memory_plan)
        self.directory = directory
        self.timeout = timeout
        self.on_event = on_event
        self.plans: PlanFn | None = None  #: set by the render service; None: no plan (the runner's defaults)
        self.output: dict[str, Any] | None = None  #: the last warm-up render's output event
        self.dropped: dict[int, dict[str, Any]] = {}  #: index -> why it is no longer warmed up (this process)
        self.rendered = 0  #: requests rendered by the last `run`

    def run(self, ctl: Any) -> float:
        """Render each request not dropped once on `ctl` (outputs discarded); returns the seconds. Raises
        `RuntimeError` when a warm-up fails for another reason than memory (the build fails)."""
        self.rendered = 0
        if not self.requests:
            return 0.0
        t0 = time.monotonic()
        directory = self.directory or Path("/tmp")
        directory.mkdir(parents=True, exist_ok=True)
        for i, kwargs in enumerate(self.requests):
            if i not in self.dropped:
                self._one(ctl, i, kwargs, directory / f"warmup-{os.getpid()}-{i}.out")
        seconds = time.monotonic() - t0
        log.info("fleet warmed up with %d of %d request(s) in %.2fs", self.rendered, len(self.requests), seconds)
        return seconds

    def _one(self, ctl: Any, i: int, kwargs: dict[str, Any], path: Path) -> None:
        try:
            plans = self.plans(kwargs) if self.plans is not None else [None]
        except WarmupRefused as exc:
            self._drop(i, kwargs, "refused", str(exc))
            return
        tries = plans[:2] or [None]  # the plan a job gets, then the lower-memory one once
        for attempt, plan in enumerate(tries):
            try:
                self._render(ctl, kwargs, plan, path)
            except Exception as exc:
                if not is_out_of_memory(exc) or not ctl.is_alive:
                    raise RuntimeError(f"warm-up request {i} failed: {type(exc).__name__}: {exc}") from exc
                if attempt + 1 < len(tries):
                    log.warning(
                        "warm-up request %d (%s) ran out of memory; retrying with the lower-memory plan %s "
                        "on the same fleet",
                        i,
                        _size(kwargs),
                        tries[attempt + 1],
                    )
                    continue
                why = "on the lower-memory plan too" if attempt else "and no lower-memory plan exists"
                self._drop(i, kwargs, "out_of_memory", f"out of memory {why}: {_first_line(exc)}")
                return
            self.rendered += 1
            return

    def _render(self, ctl: Any, kwargs: dict[str, Any], plan: dict[str, Any] | None, path: Path) -> None:
        job = {**kwargs, "output_path": str(path)}
        if plan is not None:
            job["memory_plan"] = plan
        try:
            for item in ctl.stream(timeout=self.timeout, **job):
                if isinstance(item, dict) and item.get("type") == "output":
                    self.output = item  # (its `device_memory_bytes`: the memory plan's capacity, refined)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    def _drop(self, i: int, kwargs: dict[str, Any], reason: str, message: str) -> None:
        size = _size(kwargs)
        self.dropped[i] = {"index": i, "size": size, "reason": reason, "message": message}
        log.warning(
            "warm-up request %d (%s) dropped (%s): %s; the worker starts without it and serves what fits",
            i,
            size,
            reason,
            message,
        )
        self.on_event({"type": EventType.FLEET, "action": "warmup_dropped", **self.dropped[i]})


def _size(kwargs: dict[str, Any]) -> str:
    return "x".join(str(kwargs.get(k, "?")) for k in ("width", "height", "num_frames"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
