"""The warm fleet: one warm `MGPUController` per worker process, rebuilt whenever it is poisoned.

Lifecycle: `start()` builds the controller and blocks until every rank ran `setup()` (the model is warm)
before the worker takes its first job. The controller's monitor reports a poisoned fleet at once, even
while it is idle (a rank killed between jobs): `on_failure(info)` and `on_change()` fire from the monitor
thread, the state turns `failed`, and `rebuild_soon()` starts the rebuild in a thread of its own. Before
every dequeue the worker calls `ensure_ready()`, which waits for that rebuild (or runs one) so no job is
taken until the fleet is warm again. Consecutive failed builds back off exponentially; after
`max_failures` of them `FleetUnrecoverable` is raised (in the caller of `ensure_ready()`) and the worker
process exits non-zero instead of spinning, so its supervisor (or the orchestrator) sees a crash loop.

A start is complete only after the configured warm-up requests rendered once (`warmup`: compilation, CUDA-graph
capture, allocator growth and caches for the sizes the service expects happen here, not in a client's first job).
The memory the devices offer (`device_memory_bytes`) is known once the ranks ran `setup()`, before the warm-up,
which `worker.render.warmup.WarmUp` plans like a client job: an out-of-memory warm-up is retried once on the
lower-memory plan, then dropped, never a failed build; any other warm-up error is a failed build. Before a new fleet
starts, the old one's rank processes must be gone and (where NVML can tell) listed on no GPU
(`worker.ops.procs.await_released`): at real size a new fleet loading while a dead one's memory is still held runs
out of memory. `startup` describes the last successful start: process start, weight load and warm-up seconds (see
`ltx_mgpu.control.startup`), which the worker publishes in its health snapshot and metrics.

The controller is created through `factory` (default `ltx_mgpu.MGPUController`, imported lazily: no torch at import).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ltx_contract.states import EventType
from worker.errors import WorkerError
from worker.ops.error_ids import public_message
from worker.ops.procs import await_released
from worker.render.warmup import WarmUp

__all__ = ["FleetUnrecoverable", "WarmFleet"]

log = logging.getLogger("worker.render.fleet")

EventFn = Callable[[dict[str, Any]], None]


class FleetUnrecoverable(WorkerError, RuntimeError):
    """The fleet could not be (re)built `max_failures` times in a row; the worker must exit non-zero."""


class WarmFleet:
    """Owns the worker's controller; see the module docstring."""

    def __init__(
        self,
        runner_cls: type,
        devices: Sequence[object],
        *,
        setup_kwargs: dict[str, Any] | None = None,
        start_timeout: float = 1800.0,
        shutdown_timeout: float = 30.0,
        error_settle_s: float | None = None,
        deterministic: str | None = None,
        max_failures: int = 3,
        backoff_s: float = 2.0,
        factory: Callable[..., Any] | None = None,
        on_event: EventFn | None = None,
        on_failure: EventFn | None = None,
        on_change: Callable[[], None] | None = None,
        warmup: Sequence[dict[str, Any]] = (),
        warmup_dir: Path | None = None,
        warmup_timeout: float = 3600.0,
        release_timeout: float = 120.0,
    ) -> None:
        self.runner_cls = runner_cls
        self.devices = list(devices)
        self.setup_kwargs = dict(setup_kwargs or {})
        self.start_timeout = start_timeout
        self.shutdown_timeout = shutdown_timeout
        self.error_settle_s = error_settle_s  # (MGPUController's; None: its default)
        self.deterministic = deterministic  # (MGPUController's mode, `ltx_mgpu.control.determinism`; None: its default)
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
        #: the warm-up after each start (its `plans` hook is the render service's: the plan a job gets)
        self.warm = WarmUp(warmup, directory=warmup_dir, timeout=warmup_timeout, on_event=self._event)
        self.setup_memory_bytes: int | None = None  #: what a device offers a rank after setup (least of the ranks)
        self.release_timeout = release_timeout
        self.startup: dict[str, Any] | None = None  #: the last successful start: phases in seconds, stamps

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

    @property
    def warmup(self) -> list[dict[str, Any]]:
        return self.warm.requests

    @property
    def warmup_output(self) -> dict[str, Any] | None:
        return self.warm.output

    @property
    def device_memory_bytes(self) -> int | None:
        """What one device offers this fleet's rank (the memory plan's capacity): measured after setup, then by
        each warm-up render (the least seen); None until a GPU fleet started (CPU fleets measure nothing)."""
        seen = [self.setup_memory_bytes, (self.warm.output or {}).get("device_memory_bytes")]
        measured = [int(v) for v in seen if isinstance(v, int | float) and not isinstance(v, bool) and v > 0]
        return min(measured) if measured else None

    def _event(self, event: dict[str, Any]) -> None:
        self.on_event(event)  # (late-bound: a test may replace `on_event` after construction)

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
                self.on_event({"type": EventType.FLEET, "action": "rebuilding" if rebuild else "starting"})
                t0 = time.monotonic()
                started_at = time.time()
                ctl = None
                warmup_s = 0.0
                try:
                    ctl = self._building = self._make()
                    if not self._stopped.is_set():  # (a shutdown stops `_building` from its own thread)
                        ctl.start(timeout=self.start_timeout, **self.setup_kwargs)
                        self.setup_memory_bytes = getattr(getattr(ctl, "startup", None), "device_memory_bytes", None)
                        warmup_s = self.warm.run(ctl)
                except BaseException as exc:
                    self._building = None
                    if ctl is not None:  # a failed start or warm-up: nothing of it is trusted or kept
                        self._discard(ctl, 0)
                    if not isinstance(exc, Exception):
                        raise  # a signal-driven stop (the worker's startup interrupt) or an exit: not a failure
                    if self._stopped.is_set():
                        break
                    failures += 1
                    self._build_failed(exc, failures, rebuild)
                    if self._stopped.wait(self.backoff_s * (2 ** (failures - 1))):
                        break
                    continue
                self._building = None
                if self._stopped.is_set():
                    ctl.shutdown(graceful_timeout=0)
                    break
                self._became_ready(ctl, rebuild, t0, started_at, warmup_s)
                return
            self.state = "stopped"
            raise FleetUnrecoverable("fleet start interrupted by shutdown")

    def _build_failed(self, exc: Exception, failures: int, rebuild: bool) -> None:
        """Count a failed build (`failures` in a row) and say so; `FleetUnrecoverable` once that is `max_failures`."""
        self.build_failures += 1
        self.state = "failed"
        log.error("fleet build failed (%d/%d): %s", failures, self.max_failures, exc, exc_info=True)
        self.on_event(
            {
                "type": EventType.FLEET,
                "action": "rebuild_failed" if rebuild else "start_failed",
                "error": f"{type(exc).__name__}: {exc}",
                "attempt": failures,
            }
        )
        if failures >= self.max_failures:
            raise FleetUnrecoverable(
                f"fleet on devices {self.devices} failed to start {failures} times in a row; "
                f"last error: {type(exc).__name__}: {exc}"
            ) from exc

    def _became_ready(self, ctl: Any, rebuild: bool, t0: float, started_at: float, warmup_s: float) -> None:
        """`ctl` started and warmed up: it is the fleet's controller now; its start's report (`startup`) is said."""
        self.controller = ctl
        self.ready_at = time.time()
        self.state = "ready"
        self.builds += 1
        if rebuild:
            self.rebuilds += 1
        seconds = round(time.monotonic() - t0, 3)
        self.startup = _startup_report(ctl, started_at, warmup_s, self.warm.rendered)
        if self.warm.dropped:
            self.startup["warmup_dropped"] = list(self.warm.dropped.values())
        log.info(
            "fleet ready on %s in %.2fs (pids %s): %s",
            self.devices,
            seconds,
            ctl.pids,
            {k: v for k, v in self.startup.items() if k.endswith("_s")},
        )
        self.on_event(
            {
                "type": EventType.FLEET,
                "action": "rebuilt" if rebuild else "started",
                "seconds": seconds,
                "pids": list(ctl.pids),
                "startup": self.startup,
            }
        )

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
        """A FleetFailure, machine-readable, with a one-line message (health snapshots and job errors are
        read by tenants: the ranks' tracebacks stay in the worker log under `error_id`; `worker.ops.error_ids`).
        The same failure object is described once (its monitor and the job that hit it both report it)."""
        cached = getattr(failure, "_ltx_description", None)
        if isinstance(cached, dict):
            return dict(cached)
        message, error_id = public_message(str(failure), context="fleet failure")
        info = {
            "fleet_reason": getattr(failure, "reason", None),
            "rank": getattr(failure, "rank", None),
            "pid": getattr(failure, "pid", None),
            "exitcode": getattr(failure, "exitcode", None),
            "message": message,
            "error_id": error_id,
        }
        try:
            failure._ltx_description = dict(info)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return info

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
            self.on_event({"type": EventType.FLEET, "action": "failed", **info})
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
        given = {"error_settle_s": self.error_settle_s, "deterministic": self.deterministic}
        extra = {k: v for k, v in given.items() if v is not None}  # (None: MGPUController's default)
        ctl = factory(self.runner_cls, devices=self.devices, **extra)
        register = getattr(ctl, "add_failure_callback", None)
        if register is not None:
            register(functools.partial(self._controller_failed, ctl))
        return ctl

    def _teardown(self, graceful_timeout: float | None = None) -> None:
        ctl, self.controller = self.controller, None
        if ctl is not None:
            self._discard(ctl, self.shutdown_timeout if graceful_timeout is None else graceful_timeout)

    def _discard(self, ctl: Any, graceful_timeout: float) -> None:
        """Stop a controller and wait until its ranks have released their devices."""
        pids = list(ctl.pids)
        ctl.shutdown(graceful_timeout=graceful_timeout)
        await_released(pids, self.release_timeout)


def _startup_report(ctl: Any, started_at: float, warmup_s: float, warmup_jobs: int) -> dict[str, Any]:
    """The phases of one successful start (see the module docstring), JSON-safe. With the engine's per-rank
    stamps the phases add up to `ready_s` by construction: `warmup_s` is everything after the last rank
    loaded its weights (the warm-up renders and the ready handshake)."""
    ready_at = time.time()
    engine = getattr(ctl, "startup", None)
    report: dict[str, Any] = {"started_at": started_at}
    if engine is not None:
        report.update(engine.as_dict())
        report["started_at"] = started_at  # the build attempt began before the controller existed
        report["process_start_s"] = round(max(0.0, engine.setup_began_at - started_at), 3)
        report["weight_load_s"] = round(engine.weight_load_s, 3)
        report["loaded_at"] = engine.ready_at
        warmup_s = max(0.0, ready_at - engine.ready_at)
    report.update(
        ready_at=ready_at, warmup_s=round(warmup_s, 3), warmup_jobs=warmup_jobs, ready_s=round(ready_at - started_at, 3)
    )
    return report
