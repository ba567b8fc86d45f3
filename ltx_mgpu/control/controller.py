"""`MGPUController`: a persistent, one-job-at-a-time fleet of SPMD ranks with streamed results.

Contract (written once here; docs/controller.md links to it):
- One process per rank, spawned once by `start()` and kept warm; each runs `setup()` once and then one
  job at a time, in lockstep with the others. Single machine (rendezvous on 127.0.0.1).
- `stream(**kwargs)` dispatches a job and returns a `Stream` at once; iterating it yields every rank's
  yields in arrival order and ends when every rank has finished. A job belongs to its dispatching thread;
  another `stream()` while one is in flight raises `ControllerBusyError`.
- Recoverable: any error a render raises that is not a fleet-level fault (`rank_faults.fleet_fault`) ends the
  job: `RunnerError`/`ValueError` as they are, others as `RenderFault` (`RenderOutOfMemory`). On every rank →
  `SymmetricRunnerError` (cancelled → `JobCancelledError`); on some ranks, the others finishing →
  `AsymmetricRunnerError`. The fleet stays alive.
- Fatal (`FleetFailure`, the controller is poisoned): a rank hit a fleet-level fault or exited, a job
  exceeded its timeout, some ranks ended a job with an error and the others did not end it within
  `error_settle_s` ("split": blocked in a collective), a result arrived for the wrong job (desync), or
  `shutdown()` ran mid-job. A monitor
  thread notices dead ranks and blown deadlines within ~0.1 s even while nobody iterates the stream.
- `shutdown()` is safe from any thread at any time, idempotent, never raises, and leaves no rank alive;
  `start()` may be called again afterwards.
- `add_failure_callback(fn)`: `fn(failure)` runs once per poisoned fleet, on the thread that noticed it
  (usually the monitor, so also while the fleet is idle), e.g. to rebuild at once instead of at the next job.
- `deterministic` ("auto", "on", "strict", "off", a bool; None reads `LTX_DETERMINISTIC`; "auto", the default,
  is "on" on CPU and GPU fleets alike): the switches every rank sets before its first CUDA work
  (`determinism.py`: same kwargs, layout and software, same frames and audio); `controller.deterministic` is
  the running fleet's resolved mode.
- `rank_logging`: a picklable `fn(rank)` each rank process calls first, to log as the caller does (the worker's
  JSON lines); without it a rank logs Python's way (WARNING and above, plain text on stderr).

The caller's whole side of a job (start, dispatch, the monitor, reading results) works here under one
lock on one fleet handle, so the one-job invariant is kept in one place. Spawning, watching and killing the
rank processes is `processes.py`, the job handle and how a job's end is classified `stream.py`, the rank
side `fleet.py`, the wire types `transport.py`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as tmp

from ..os_limits import raise_open_files_limit
from . import determinism
from .devices import choose_backend, normalize_devices
from .errors import ControllerBusyError, FleetFailure, FleetTimeoutError
from .fleet import check_job_kwargs
from .job_board import cancel_key
from .processes import FleetProcesses, await_ready, exited_rank_failure, spawn_fleet
from .runner import MGPURunner
from .startup import FleetStartup
from .stream import Stream
from .transport import ChannelClosed, ChannelTimeout, Job, Result, receive_any, split_tensors

__all__ = ["MGPUController"]

log = logging.getLogger("ltx_mgpu.control.controller")

_MONITOR_POLL_S = 0.1
# An idle driver rank reads the next job at once and a CPU rank reads its tensors as soon as the job is announced,
# so a dispatch that finds no room in a pipe for this long means the fleet is wedged (it is poisoned).
_DISPATCH_TIMEOUT_S = 60.0
_DEAD_MESSAGE = "MGPUController is dead; create a new one."


class MGPUController:
    """A warm fleet running `runner_cls` on `devices` (or CUDA `0..num_gpus-1`); see the module docstring.

    `devices` entries are CUDA indices, "cuda:N" or "cpu" (CPU ranks run over gloo; `["cpu"] * 4` is a
    world of four). Several ranks may share one GPU only with `allow_shared_devices=True` (then gloo).
    """

    def __init__(
        self,
        runner_cls: type[MGPURunner],
        *,
        num_gpus: int | None = None,
        devices: Sequence[int | str | torch.device] | None = None,
        allow_shared_devices: bool = False,
        backend: str | None = None,
        error_settle_s: float = 30.0,
        deterministic: str | bool | None = None,
        rank_logging: Callable[[int], None] | None = None,
    ) -> None:
        if num_gpus is not None and devices is not None:
            raise ValueError("Pass either num_gpus or devices, not both.")
        if not (isinstance(runner_cls, type) and issubclass(runner_cls, MGPURunner)):
            raise TypeError(f"runner_cls must be an MGPURunner subclass, got {runner_cls!r}")
        self._runner_cls = runner_cls
        self._num_gpus = num_gpus
        self._devices = (
            normalize_devices(list(devices), allow_shared=allow_shared_devices) if devices is not None else None
        )
        if backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl', 'gloo' or None (auto), got {backend!r}")
        self._backend_override = backend
        # Once a rank ended a job with an error, the others get this long to end it too; after that they
        # are taken to be blocked in a collective the raising ranks left, and the fleet is poisoned.
        self._error_settle_s = float(error_settle_s)
        if deterministic is not None:
            determinism.resolve(deterministic)  # (a bad value fails here, not in the ranks)
        self._deterministic = deterministic
        self._rank_logging = rank_logging
        self._ctx = tmp.get_context("spawn")
        self._lock = threading.Lock()  # guards the in-flight check-and-set and the lifecycle fields
        self._next_job_id = 0  # monotonic over the controller's life (desync detection)
        self._inflight: Stream | None = None
        self._fatal: FleetFailure | None = None  # one-way poison per fleet generation
        self._fleet: FleetProcesses | None = None
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()  # set while shutdown() tears the fleet down
        self._finalizer: weakref.finalize | None = None
        self._failure_callbacks: list[Callable[[FleetFailure], None]] = []
        self.world_size = 0
        self.devices: list[str] = []
        self.backend = ""
        self.deterministic = "off"  #: the running fleet's deterministic mode ("on", "strict", "off"; `determinism`)
        self.startup: FleetStartup | None = None  #: what the last successful `start()` took, per rank

    # ==== lifecycle =================================================================================

    @property
    def is_alive(self) -> bool:
        """Started, not poisoned, not shut down."""
        return self._fleet is not None and self._fatal is None and not self._stopping.is_set()

    @property
    def pids(self) -> list[int]:
        fleet = self._fleet
        return [p.pid for p in fleet.procs] if fleet else []

    def add_failure_callback(self, fn: Callable[[FleetFailure], None]) -> None:
        """Call `fn(failure)` whenever this controller's fleet is poisoned (not on `shutdown()`): once per
        fleet generation, from the thread that noticed it (the monitor for deaths and timeouts, even while
        idle; the iterating thread for a desync). Keep it short and non-blocking; exceptions are logged."""
        self._failure_callbacks.append(fn)

    def start(self, *, timeout: float | timedelta = 1800.0, **setup_kwargs: Any) -> None:
        """Spawn the ranks and block until every one has run `setup(**setup_kwargs)`.

        `timeout` bounds process-group creation plus `setup()` (it must exceed the slowest model load).
        On a rank crash or timeout the half-started fleet is torn down and the error raised.
        """
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        raise_open_files_limit()  # (tensors cross to and from the ranks as file descriptors; ranks inherit it)
        with self._lock:
            if self._fleet is not None:
                raise RuntimeError("MGPUController.start() called twice")
            devices = self._resolve_devices()
            self.devices = devices
            self.world_size = len(devices)
            self.backend = self._backend_override or choose_backend(devices)
            self.deterministic = determinism.resolve(self._deterministic)
            if self.backend == "nccl" and len(set(devices)) != len(devices):
                raise ValueError("NCCL needs one distinct GPU per rank; use backend='gloo' to share GPUs")
            self._fatal = None
            self._inflight = None
            self._stopping.clear()
            self.startup = None
            started_at = time.time()
            self._fleet = spawn_fleet(
                self._ctx,
                self._runner_cls,
                devices,
                self.backend,
                timeout_s,
                setup_kwargs,
                self.deterministic,
                rank_logging=self._rank_logging,
            )
            self._finalizer = weakref.finalize(self, FleetProcesses.terminate, self._fleet, 1.0)
        try:
            ranks = await_ready(self._fleet, self.world_size, timeout_s)
        except BaseException:
            self.shutdown(graceful_timeout=0)
            raise
        self._monitor = threading.Thread(
            target=self._monitor_loop, args=(self._fleet,), name="ltx-mgpu-monitor", daemon=True
        )
        self._monitor.start()
        self.startup = FleetStartup(started_at, tuple(ranks))
        log.info("MGPU fleet ready (%d workers, %s, devices %s).", self.world_size, self.backend, devices)

    def _resolve_devices(self) -> list[str]:
        if self._devices is not None:
            return list(self._devices)
        count = self._num_gpus if self._num_gpus is not None else torch.cuda.device_count()
        if count <= 0:
            raise ValueError(f"No GPUs available: num_gpus={self._num_gpus}.")
        return [f"cuda:{i}" for i in range(count)]

    def shutdown(self, *, graceful_timeout: float = 60.0) -> None:
        """Stop every rank: announce shutdown, wait up to `graceful_timeout` s, then SIGTERM/SIGKILL.

        Safe from any thread at any time; idempotent; never raises. A job in flight ends with a
        `FleetFailure(reason="shutdown")` in its iterating thread.
        """
        try:
            with self._lock:
                fleet = self._fleet
                if fleet is None:
                    return
                self._stopping.set()
                inflight = self._inflight
            if inflight is not None and not inflight._finished:
                self._poison(
                    fleet,
                    FleetFailure(f"MGPU job {inflight.job_id} aborted: controller shut down", reason="shutdown"),
                    terminate=False,
                )
            with contextlib.suppress(Exception):
                fleet.channels.jobs.put(None, timeout=1.0)
            deadline = time.monotonic() + max(0.0, graceful_timeout)
            while not fleet.all_exited() and time.monotonic() < deadline:
                time.sleep(0.02)
            fleet.terminate()
            if self._monitor is not None and self._monitor is not threading.current_thread():
                self._monitor.join(2.0)
            fleet.close()
            with self._lock:
                self._fleet = None
                self._monitor = None
                self._inflight = None
                if self._finalizer is not None:
                    self._finalizer.detach()
                    self._finalizer = None
        except Exception:  # never raise from shutdown: it is the last-resort kill switch
            log.exception("MGPUController.shutdown: unexpected error (ignored)")

    def __enter__(self) -> MGPUController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(graceful_timeout=10.0)

    # ==== jobs ======================================================================================

    def stream(self, *, timeout: float | None = None, **kwargs: Any) -> Stream:
        """Dispatch one job and return its `Stream` at once. `timeout` (s) runs from dispatch."""
        check_job_kwargs(self._runner_cls, kwargs)
        with self._lock:
            if self._fleet is None:
                raise RuntimeError("MGPUController not started; call start() first")
            if self._fatal is not None:
                raise RuntimeError(_DEAD_MESSAGE) from self._fatal
            if self._inflight is not None:
                raise ControllerBusyError(self._inflight.job_id)
            job_id = self._next_job_id
            self._next_job_id += 1
            deadline = None if timeout is None else time.monotonic() + timeout
            stream = Stream(self, self._fleet, job_id, threading.get_ident(), deadline, timeout)
            self._inflight = stream
            fleet = self._fleet
        skeleton, tensors = split_tensors(kwargs)
        try:
            self._dispatch(fleet, Job(job_id=job_id, skeleton=skeleton, tensors=tensors))
        except BaseException:
            stream._finished = True
            self._finish(stream)
            raise
        return stream

    def _dispatch(self, fleet: FleetProcesses, job: Job) -> None:
        """Hand the job to the fleet: its top-level tensors to every CPU rank > 0 (see fleet.py), then the
        job to the driver rank. Bounded: a poisoned fleet or a pipe nobody empties raises instead of blocking."""

        def alive() -> bool:
            return self._fatal is None and fleet is self._fleet

        try:
            if job.tensors:
                for channel in fleet.channels.tensors.values():
                    channel.put((job.job_id, job.tensors), alive=alive, timeout=_DISPATCH_TIMEOUT_S)
            fleet.channels.jobs.put(job, alive=alive, timeout=_DISPATCH_TIMEOUT_S)
        except (ChannelClosed, ChannelTimeout) as exc:
            failure: FleetFailure
            if isinstance(exc, ChannelTimeout):
                failure = FleetTimeoutError(
                    f"MGPU job {job.job_id}: the fleet took no input for {_DISPATCH_TIMEOUT_S:.0f}s ({exc})",
                    reason="timeout",
                )
            else:
                failure = FleetFailure(f"MGPU job {job.job_id} not dispatched: {exc}", reason="shutdown")
            self._poison(fleet, failure, terminate=True)
            raise (self._fatal or failure) from exc

    def _finish(self, stream: Stream) -> None:
        with self._lock:
            if self._inflight is stream:
                self._inflight = None
        with contextlib.suppress(Exception):
            stream._fleet.store.delete_key(cancel_key(stream.job_id))

    def _poison(self, fleet: FleetProcesses, failure: FleetFailure, *, terminate: bool) -> None:
        """Record the first fatal error, wake the iterating thread, optionally kill the ranks."""
        with self._lock:
            if fleet is not self._fleet:
                return
            first = self._fatal is None
            if first:
                self._fatal = failure
            inflight = self._inflight
        if first:
            if failure.reason != "shutdown":
                log.error("MGPU fleet failed: %s", failure)
                for fn in list(self._failure_callbacks):
                    try:
                        fn(failure)
                    except Exception:
                        log.exception("MGPU failure callback %r raised (ignored)", fn)
            if inflight is not None:
                fleet.waker.wake()  # the iterating thread raises the stored failure at once
        if terminate:
            fleet.terminate()

    # ==== monitoring ================================================================================

    def _monitor_loop(self, fleet: FleetProcesses) -> None:
        """Notice dead ranks and blown job deadlines without anyone iterating the stream."""
        sentinels = [p.sentinel for p in fleet.procs]
        while not self._stopping.is_set() and self._fatal is None:
            multiprocessing.connection.wait(sentinels, timeout=_MONITOR_POLL_S)
            if self._stopping.is_set():
                return
            failure = exited_rank_failure(fleet, during=None)
            if failure is not None:
                self._poison(fleet, failure, terminate=True)
                return
            inflight = self._inflight
            if inflight is not None and not inflight._finished and (split := inflight._split_failure()):
                self._poison(fleet, split, terminate=True)
                return
            if inflight is not None and inflight._deadline is not None and not inflight._finished:
                if time.monotonic() > inflight._deadline:
                    self._poison(
                        fleet,
                        FleetTimeoutError(
                            f"MGPU job {inflight.job_id} exceeded {inflight._timeout}s", reason="timeout"
                        ),
                        terminate=True,
                    )
                    return

    # ==== used by Stream ============================================================================

    def _next_result(self, stream: Stream) -> Result:
        """Block for the next message of `stream`'s job; raise the fleet's failure if it has one."""
        fleet = stream._fleet
        while True:
            if self._fatal is not None and (fleet is self._fleet or self._fleet is None):
                raise self._fatal
            if fleet is not self._fleet:
                # Its pipes are closed, and their descriptor numbers may already belong to a newer fleet's
                # pipes: never read them (a READY stolen from a new fleet would wedge its start).
                raise FleetFailure(f"MGPU job {stream.job_id}: fleet is gone", reason="shutdown")
            try:
                got = receive_any(fleet.channels.up, 0.25, alive=lambda: self._fatal is None, waker=fleet.waker)
            except (OSError, EOFError, ValueError):  # (ChannelClosed is an EOFError; a closed fd a ValueError)
                got = None
            if got is None:
                continue
            msg: Result = got[1]
            if msg.job_id != stream.job_id:
                failure = FleetFailure(
                    f"MGPU fleet desync: rank {msg.rank} sent job {msg.job_id}, expected {stream.job_id}.",
                    reason="desync",
                    rank=msg.rank,
                )
                self._poison(fleet, failure, terminate=True)
                raise self._fatal or failure
            return msg
