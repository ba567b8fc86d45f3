"""Fleet supervision: one warm `MGPUController` per worker process, rebuilt whenever it is poisoned.

Lifecycle: `start()` builds the controller and blocks until every rank ran `setup()` (the model is warm)
before the worker takes its first job. The controller's monitor reports a poisoned fleet at once, even
while it is idle (a rank killed between jobs): `on_failure(info)` and `on_change()` fire from the monitor
thread, the state turns `failed`, and `rebuild_soon()` starts the rebuild in a thread of its own. Before
every dequeue the worker calls `ensure_ready()`, which waits for that rebuild (or runs one) so no job is
taken until the fleet is warm again. Consecutive failed builds back off exponentially; after
`max_failures` of them `FleetUnrecoverable` is raised (in the caller of `ensure_ready()`) and the worker
process exits non-zero instead of spinning, so its supervisor (or the orchestrator) sees a crash loop.

The controller is created through `factory` (default `ltx_mgpu.MGPUController`), imported lazily so this
module can be imported without torch.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FleetSupervisor", "FleetUnrecoverable"]

log = logging.getLogger("worker.fleet")

EventFn = Callable[[dict[str, Any]], None]
FLEET_STATES = ("new", "starting", "ready", "failed", "stopped")


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
        on_failure: EventFn | None = None,
        on_change: Callable[[], None] | None = None,
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
        self.on_failure = on_failure or (lambda _info: None)  #: a fleet was poisoned: info (monitor thread)
        self.on_change = on_change or (lambda: None)  #: `state` or liveness changed (any thread)
        self.controller: Any = None
        self._state = "new"  #: new → starting → ready → (failed → starting → ready)* → stopped
        self.builds = 0  #: successful builds (1 = the initial start)
        self.rebuilds = 0  #: successful builds after a failure
        self.build_failures = 0  #: failed build attempts, all time
        self.last_failure: dict[str, Any] | None = None
        self.failures = 0  #: poisoned fleets, all time
        self.ready_at: float | None = None  #: wall-clock time the current controller became warm
        self._recorded: list[BaseException] = []  # failures counted lately (the monitor and the job report each)
        self._lock = threading.RLock()  # held for a whole (re)build
        self._small_lock = threading.Lock()  # failure bookkeeping and the rebuild thread; never held long
        self._stopped = threading.Event()
        self._rebuild_thread: threading.Thread | None = None
        self._building: Any = None  # the controller being started (shutdown()/kill() stop it without the lock)
        self._rebuild_error: FleetUnrecoverable | None = None

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        changed = value != self._state
        self._state = value
        if changed:
            self._notify()

    def _notify(self) -> None:
        try:
            self.on_change()
        except Exception:
            log.warning("fleet on_change hook failed", exc_info=True)

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
                    ctl = self._building = self._make()
                    if not self._stopped.is_set():  # (a shutdown stops `_building` from its own thread)
                        ctl.start(timeout=self.start_timeout, **self.setup_kwargs)
                except Exception as exc:
                    self._building = None
                    if self._stopped.is_set():
                        break
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
                self._building = None
                if self._stopped.is_set():
                    ctl.shutdown(graceful_timeout=0)
                    break
                self.controller = ctl
                self.ready_at = time.time()
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

    def ensure_ready(self, *, tick: Callable[[], None] | None = None) -> bool:
        """Make sure the controller is warm: if it is dead or poisoned, (re)build it in the rebuild thread
        (or wait for the rebuild already running there), calling `tick()` about once a second meanwhile.
        Returns True if a rebuild happened; raises `FleetUnrecoverable` if rebuilds gave up."""
        if self.is_alive and self._rebuild_thread is None:
            return False
        if self.controller is not None and not self.is_alive:
            log.warning("fleet on %s is not alive (%s); rebuilding", self.devices, self.last_failure)
        self.rebuild_soon()
        with self._small_lock:
            thread = self._rebuild_thread
        while thread is not None and thread.is_alive():
            thread.join(1.0)
            if tick is not None and thread.is_alive():
                try:
                    tick()
                except Exception:
                    log.debug("tick during a fleet rebuild failed", exc_info=True)
        with self._small_lock:
            error, self._rebuild_error = self._rebuild_error, None
            if self._rebuild_thread is thread:
                self._rebuild_thread = None
        if error is not None:
            raise error
        if not self.is_alive:
            raise FleetUnrecoverable("fleet rebuild ended without a live fleet (stopped meanwhile)")
        return thread is not None

    def rebuild_soon(self) -> None:
        """Start rebuilding in a thread of its own now (idempotent); `ensure_ready()` waits for it."""
        with self._small_lock:
            running = self._rebuild_thread is not None and self._rebuild_thread.is_alive()
            if running or self._stopped.is_set():
                return
            self._rebuild_thread = threading.Thread(target=self._rebuild, name="ltx-fleet-rebuild", daemon=True)
            self._rebuild_thread.start()

    def _rebuild(self) -> None:
        try:
            self.start()
        except FleetUnrecoverable as exc:
            with self._small_lock:
                self._rebuild_error = exc
        except Exception as exc:  # a bug here must not leave ensure_ready() waiting or the fleet unreported
            with self._small_lock:
                self._rebuild_error = FleetUnrecoverable(f"fleet rebuild crashed: {type(exc).__name__}: {exc}")
            log.exception("fleet rebuild crashed")

    @staticmethod
    def describe(failure: BaseException) -> dict[str, Any]:
        """A FleetFailure, machine-readable."""
        return {
            "fleet_reason": getattr(failure, "reason", None),
            "rank": getattr(failure, "rank", None),
            "pid": getattr(failure, "pid", None),
            "exitcode": getattr(failure, "exitcode", None),
            "message": str(failure),
        }

    def record_failure(self, failure: BaseException) -> dict[str, Any]:
        """Count a poisoned fleet once (its monitor's callback and the job that hit it both report the same
        failure object, in either order, maybe after a rebuild began), mark it for rebuild, tell
        `on_failure`. Returns the description."""
        info = self.describe(failure)
        with self._small_lock:
            first = not any(f is failure for f in self._recorded)
            if first:
                self._recorded = [*self._recorded[-7:], failure]
        if first:
            self.failures += 1
            self.last_failure = info
            self.on_event({"type": "fleet", "action": "failed", **info})
            try:
                self.on_failure(info)
            except Exception:
                log.warning("fleet on_failure hook failed", exc_info=True)
            self.state = "failed"
        return info

    def _controller_failed(self, controller: Any, failure: BaseException) -> None:
        """The controller's monitor (or iterating thread) poisoned `controller`: record it, rebuild now."""
        if controller is not self.controller:
            return  # an old generation's late report
        self.record_failure(failure)
        self.rebuild_soon()

    def shutdown(self, graceful_timeout: float | None = None) -> None:
        """Stop the fleet (every rank); idempotent. Interrupts a rebuild back-off or a start in progress."""
        self._stopped.set()
        self._stop_building()
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
        self._stop_building()
        ctl = self.controller
        if ctl is not None:
            ctl.shutdown(graceful_timeout=0)

    # ---- internals -----------------------------------------------------------------------------------
    def _stop_building(self) -> None:
        building = self._building
        if building is not None:
            building.shutdown(graceful_timeout=0)

    def _make(self) -> Any:
        factory = self._factory
        if factory is None:
            from ltx_mgpu import MGPUController

            factory = MGPUController
        ctl = factory(self.runner_cls, devices=self.devices)
        register = getattr(ctl, "add_failure_callback", None)
        if register is not None:
            register(functools.partial(self._controller_failed, ctl))
        return ctl

    def _teardown(self, graceful_timeout: float | None = None) -> None:
        ctl, self.controller = self.controller, None
        if ctl is not None:
            timeout = self.shutdown_timeout if graceful_timeout is None else graceful_timeout
            ctl.shutdown(graceful_timeout=timeout)
