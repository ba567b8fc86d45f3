"""Fleet supervision: one warm `MGPUController` per worker process, rebuilt whenever it is poisoned.

Lifecycle: `start()` builds the controller and blocks until every rank ran `setup()` (the model is warm)
before the worker takes its first job. After a `FleetFailure` the job that hit it fails (or is re-queued)
and `ensure_ready()` — called before every dequeue — shuts the dead controller down (no rank survives)
and starts a new one. Consecutive failed builds back off exponentially; after `max_failures` of them
`FleetUnrecoverable` is raised and the worker process exits non-zero instead of spinning, so its
supervisor (or the orchestrator) sees a crash loop.

The controller is created through `factory` (default `ltx_mgpu.MGPUController`), imported lazily so this
module can be imported without torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FleetSupervisor", "FleetUnrecoverable"]

log = logging.getLogger("worker.fleet")

EventFn = Callable[[dict[str, Any]], None]


class FleetUnrecoverable(RuntimeError):
    """The fleet could not be (re)built `max_failures` times in a row; the worker must exit non-zero."""


class FleetSupervisor:
    """Owns the worker's controller; see the module docstring."""

    def __init__(
        self,
        runner_cls: type,
        devices: Sequence[object],
        *,
        setup_kwargs: dict[str, Any] | None = None,
        start_timeout: float = 1800.0,
        shutdown_timeout: float = 30.0,
        max_failures: int = 3,
        backoff_s: float = 2.0,
        factory: Callable[..., Any] | None = None,
        on_event: EventFn | None = None,
    ) -> None:
        self.runner_cls = runner_cls
        self.devices = list(devices)
        self.setup_kwargs = dict(setup_kwargs or {})
        self.start_timeout = start_timeout
        self.shutdown_timeout = shutdown_timeout
        self.max_failures = max_failures
        self.backoff_s = backoff_s
        self._factory = factory
        self.on_event = on_event or (lambda _event: None)
        self.controller: Any = None
        self.state = "new"  #: new → starting → ready → (failed → starting → ready)* → stopped
        self.builds = 0  #: successful builds (1 = the initial start)
        self.rebuilds = 0  #: successful builds after a failure
        self.build_failures = 0  #: failed build attempts, all time
        self.last_failure: dict[str, Any] | None = None
        self._lock = threading.RLock()
        self._stopped = threading.Event()

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        ctl = self.controller
        return ctl is not None and bool(ctl.is_alive)

    @property
    def pids(self) -> list[int]:
        ctl = self.controller
        return list(ctl.pids) if ctl is not None else []

    @property
    def world_size(self) -> int:
        return len(self.devices)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Build and start the controller (retrying with back-off); raise FleetUnrecoverable on give-up."""
        with self._lock:
            if self.is_alive:
                return
            rebuild = self.builds > 0
            failures = 0
            while not self._stopped.is_set():
                self._teardown()
                self.state = "starting"
                self.on_event({"type": "fleet", "action": "rebuilding" if rebuild else "starting"})
                t0 = time.monotonic()
                try:
                    ctl = self._make()
                    ctl.start(timeout=self.start_timeout, **self.setup_kwargs)
                except Exception as exc:
                    failures += 1
                    self.build_failures += 1
                    self.state = "failed"
                    log.error("fleet build failed (%d/%d): %s", failures, self.max_failures, exc, exc_info=True)
                    self.on_event({"type": "fleet", "action": "rebuild_failed" if rebuild else "start_failed",
                                   "error": f"{type(exc).__name__}: {exc}", "attempt": failures})  # fmt: skip
                    if failures >= self.max_failures:
                        raise FleetUnrecoverable(
                            f"fleet on devices {self.devices} failed to start {failures} times in a row; "
                            f"last error: {type(exc).__name__}: {exc}"
                        ) from exc
                    if self._stopped.wait(self.backoff_s * (2 ** (failures - 1))):
                        break
                    continue
                self.controller = ctl
                self.state = "ready"
                self.builds += 1
                if rebuild:
                    self.rebuilds += 1
                seconds = round(time.monotonic() - t0, 3)
                log.info("fleet ready on %s in %.2fs (pids %s)", self.devices, seconds, ctl.pids)
                self.on_event({"type": "fleet", "action": "rebuilt" if rebuild else "started",
                               "seconds": seconds, "pids": list(ctl.pids)})  # fmt: skip
                return
            self.state = "stopped"
            raise FleetUnrecoverable("fleet start interrupted by shutdown")

    def ensure_ready(self) -> bool:
        """Rebuild the controller if it is dead or poisoned. Returns True if a rebuild happened."""
        with self._lock:
            if self.is_alive:
                return False
            if self.controller is not None:
                log.warning("fleet on %s is not alive (%s); rebuilding", self.devices, self.last_failure)
            self.start()
            return True

    def record_failure(self, failure: BaseException) -> dict[str, Any]:
        """Describe a FleetFailure (machine-readable) and mark the fleet for rebuild."""
        info = {
            "fleet_reason": getattr(failure, "reason", None),
            "rank": getattr(failure, "rank", None),
            "pid": getattr(failure, "pid", None),
            "exitcode": getattr(failure, "exitcode", None),
            "message": str(failure),
        }
        self.last_failure = info
        self.state = "failed"
        self.on_event({"type": "fleet", "action": "failed", **info})
        return info

    def shutdown(self, graceful_timeout: float | None = None) -> None:
        """Stop the fleet (every rank); idempotent. Interrupts a rebuild back-off."""
        self._stopped.set()
        with self._lock:
            self._teardown(graceful_timeout)
            self.state = "stopped"

    def stop_retrying(self) -> None:
        """Make a running `start()` give up after its current attempt (no lock: callable from a signal
        handler running on the thread that holds it)."""
        self._stopped.set()

    def kill_for_rebuild(self) -> None:
        """Kill the ranks now because the fleet cannot be trusted (e.g. abandoned mid-job); the next
        `ensure_ready()` builds a new one."""
        ctl = self.controller
        self.state = "failed"
        if ctl is not None:
            ctl.shutdown(graceful_timeout=0)

    def kill(self) -> None:
        """Cold stop: kill the ranks now, from any thread (does not wait for the lock holder)."""
        self._stopped.set()
        ctl = self.controller
        if ctl is not None:
            ctl.shutdown(graceful_timeout=0)

    # ---- internals -----------------------------------------------------------------------------------
    def _make(self) -> Any:
        factory = self._factory
        if factory is None:
            from ltx_mgpu import MGPUController

            factory = MGPUController
        return factory(self.runner_cls, devices=self.devices)

    def _teardown(self, graceful_timeout: float | None = None) -> None:
        ctl, self.controller = self.controller, None
        if ctl is not None:
            timeout = self.shutdown_timeout if graceful_timeout is None else graceful_timeout
            ctl.shutdown(graceful_timeout=timeout)
