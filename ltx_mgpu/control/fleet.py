"""The fleet: spawning one process per rank, the rank-side loops, and teardown. No job semantics here
beyond running one generator per announced job; classification lives in `stream.py`.

Rank lifecycle (every rank, SPMD):
  1. ignore SIGINT (Ctrl+C stops the controller, which stops its ranks), start a parent watchdog, keep NVLink
     multicast off (`devices.MULTICAST_OFF_ENV`) unless set, set the mode's switches (`determinism.apply`);
  2. bind the device (`set_device(devices[rank])`), instantiate the runner (its `__init__` is a pre-init hook);
  3. join the process group through the controller's TCPStore; create the component groups;
  4. `runner.setup(**setup_kwargs)`, then report ready with its start timestamps (`startup.RankStartup`);
  5. loop: the driver (rank 0) takes a job from the controller and posts it on the job board; other ranks wait
     on the board outside collectives; every rank gets the job's top-level tensors (below); everyone runs it;
  6. on the shutdown announcement: tear down the process group and exit 0.
An exception a render raises ends the job, not the rank (`_run_job`): `RunnerError`/`ValueError` as they are,
anything else as a `RenderFault` (its traceback in this rank's log; an out-of-memory error as a
`RenderOutOfMemory`, after the job's memory was released). A fleet-level fault (`rank_faults.fleet_fault`: a
`torch.distributed` error, CUDA context loss, SystemExit) and anything outside a job is reported on the
`failures` channel with its traceback, and the rank exits 1: a collective it may have left half-entered
cannot be unwound.

Top-level tensor kwargs, one path per device kind:
- CPU fleets: the caller's tensors are in shared memory; rank 0 gets them inside the `Job`, rank r > 0 from
  its own `tensors[r]` channel (the controller writes one message there per job that has tensors, and the
  rank reads exactly that message once the job is announced). Every rank takes a private copy.
- GPU fleets: rank 0 gets them by CUDA IPC inside the `Job` and broadcasts them over the transformer
  backend (NCCL); no `tensors` channels exist.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import inspect
import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import determinism
from .devices import ALLOCATOR_ENV, MULTICAST_OFF_ENV
from .errors import RenderFault, RenderOutOfMemory, RunnerError
from .job_board import CancelPoints, JobBoard, cancel_key
from .memory_report import live_memory_report
from .rank_faults import fleet_fault, job_error
from .runner import MGPURunner, ProcessGroups, RankContext
from .startup import ready_stamp
from .transport import Channel, Failure, Job, MessageKind, Result, fill_tensors, placeholders

__all__ = ["FleetChannels", "RankBoot", "RankChannels", "ship_runner"]

log = logging.getLogger("ltx_mgpu.control.fleet")

DRIVER_RANK = 0


@dataclass
class RankChannels:
    """One rank's ends: each channel has one writing process (no cross-process lock: see transport.py)."""

    up: Channel  #: this rank → controller: READY once `setup()` returned, then its jobs' `Result`s
    failures: Channel  #: this rank → controller: a `Failure` right before the rank exits 1
    jobs: Channel | None  #: controller → driver rank (rank 0 only)
    tensors: Channel | None  #: controller → this rank (CPU fleets, rank > 0): (job_id, top-level tensors)


@dataclass
class FleetChannels:
    """The pipes of one fleet generation (recreated on every `start()`)."""

    jobs: Channel  #: controller → driver rank
    up: list[Channel]  #: rank r → controller, by rank
    failures: list[Channel]  #: rank r → controller, by rank
    tensors: dict[int, Channel]  #: controller → rank r > 0 of a CPU fleet

    @classmethod
    def create(cls, ctx: Any, devices: list[str]) -> FleetChannels:
        """The channels for a fleet on `devices`; `tensors` only where that path is used (CPU, rank > 0)."""
        world = len(devices)
        return cls(
            jobs=Channel(ctx),
            up=[Channel(ctx) for _ in range(world)],
            failures=[Channel(ctx) for _ in range(world)],
            tensors={rank: Channel(ctx) for rank in range(1, world)} if devices[0] == "cpu" else {},
        )

    def for_rank(self, rank: int) -> RankChannels:
        jobs = self.jobs if rank == DRIVER_RANK else None
        return RankChannels(up=self.up[rank], failures=self.failures[rank], jobs=jobs, tensors=self.tensors.get(rank))

    def all(self) -> list[Channel]:
        return [self.jobs, *self.up, *self.failures, *self.tensors.values()]


@dataclass
class RankBoot:
    """Everything a rank needs, pickled once into its spawn arguments."""

    rank: int
    world_size: int
    devices: list[str]
    backend: str
    store_port: int
    init_timeout_s: float
    runner_payload: bytes  #: the runner class, cloudpickled (by value unless it lives in ltx_mgpu)
    setup_kwargs: dict[str, Any]
    channels: RankChannels
    scratch_dir: str  #: the fleet's temporary directory, owned (and removed) by the controller
    deterministic: str = "off"  #: the fleet's resolved mode (`determinism.resolve`): "on", "strict" or "off"


def ship_runner(runner_cls: type[MGPURunner]) -> bytes:
    """Pickle the runner class so it survives spawn: by value (its module too) unless it is one of ours.

    By value makes runners defined in `__main__`, a test module or a notebook work in fresh interpreters;
    our own runners travel by reference so their module-level imports happen normally. A few module
    globals cannot be pickled by value (e.g. a reference to `torch.backends.cudnn`); such a runner still
    ships by reference when its module is importable (spawned ranks inherit the caller's `sys.path`).
    """
    name = runner_cls.__module__
    module = sys.modules.get(name)
    if module is None or name.startswith("ltx_mgpu.") or name == "__main__":
        return cloudpickle.dumps(runner_cls)  # __main__ classes are pickled by value by cloudpickle itself
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(runner_cls)
    except Exception:
        if importlib.util.find_spec(name) is None:
            raise
        log.warning("runner %s: by-value pickling failed; shipping by reference", runner_cls.__qualname__)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return cloudpickle.dumps(runner_cls)


# ==== rank side ===============================================================================


def rank_main(boot: RankBoot) -> None:
    """Spawn target. Never returns normally on failure: reports, then `os._exit(1)`."""
    booted_at = time.time()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for key, value in {**MULTICAST_OFF_ENV, **ALLOCATOR_ENV}.items():  # before any communicator or allocation
        os.environ.setdefault(key, value)
    # Temporary files of this process (multiprocessing's `pymp-*` directory, made when a yielded tensor is
    # shared by file descriptor) go into the fleet's scratch directory: a rank that is killed or exits
    # with os._exit runs no exit handlers, and the controller removes the whole directory.
    tempfile.tempdir = boot.scratch_dir
    _start_parent_watchdog(boot.scratch_dir)
    try:
        determinism.apply(boot.deterministic)  # before cuBLAS, cuDNN or a communicator exists here
        _run_rank(boot, booted_at)
    except BaseException:
        tb = traceback.format_exc()
        with contextlib.suppress(BaseException):
            boot.channels.failures.put(Failure(rank=boot.rank, pid=os.getpid(), traceback=tb), timeout=5)
        sys.stderr.write(f"[ltx_mgpu rank {boot.rank} pid {os.getpid()}] fatal:\n{tb}")
        sys.stderr.flush()
        os._exit(1)


def _start_parent_watchdog(scratch_dir: str) -> None:
    """Exit when the controller process dies, so an orphaned fleet never holds GPUs; remove the fleet's
    scratch directory on the way out (nobody else is left to)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        shutil.rmtree(scratch_dir, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="ltx-mgpu-parent-watchdog", daemon=True).start()


def _run_rank(boot: RankBoot, booted_at: float) -> None:
    device = torch.device(boot.devices[boot.rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the machine's cores: without a split, every rank's intra-op pool spans all of
        # them and a world of 2 runs ~10x slower than it should from oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // boot.world_size))
    runner_cls = cloudpickle.loads(boot.runner_payload)
    runner: MGPURunner = runner_cls()
    runner.start_background_imports()  # overlap setup()'s slow late imports with what follows

    timeout = timedelta(seconds=boot.init_timeout_s)
    store = dist.TCPStore("127.0.0.1", boot.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=boot.backend,
        store=dist.PrefixStore("pg/", store),
        rank=boot.rank,
        world_size=boot.world_size,
        timeout=timeout,
        device_id=device if boot.backend == "nccl" else None,
    )
    try:
        groups = ProcessGroups(
            gemma_group=dist.new_group(),
            transformer_group=dist.new_group(),
            vae_group=dist.new_group(),
            control_group=dist.new_group(backend="gloo"),
        )
        runner._groups = groups
        runner._ctx = RankContext(boot.rank, boot.world_size, device, boot.backend)
        setup_began_at = time.time()
        runner.setup(**boot.setup_kwargs)
        stamp = ready_stamp(boot.rank, runner, device, booted_at, setup_began_at)
        boot.channels.up.put(Result(kind=MessageKind.READY, job_id=-1, rank=boot.rank, value=stamp))
        _job_loop(boot, runner, store, device)
    finally:
        _teardown(device)


def _job_loop(boot: RankBoot, runner: MGPURunner, store: dist.Store, device: torch.device) -> None:
    board = JobBoard(store)
    results = boot.channels.up
    is_driver = boot.rank == DRIVER_RANK
    while True:
        if is_driver:
            assert boot.channels.jobs is not None
            job: Job | None = _take_job(boot.channels.jobs)
            if job is None:
                board.post(None)
                return
            board.post((job.job_id, job.skeleton))
            job_id, skeleton = job.job_id, job.skeleton
            tensors = _driver_tensors(boot, job.tensors, device)
        else:
            announcement = board.next()
            if announcement is None:
                return
            job_id, skeleton = announcement
            tensors = _receive_tensors(boot, job_id, skeleton, device)
        if runner._cancel_points is not None:
            runner._cancel_points.cleanup()  # the previous job's keys: every rank is past it by now
        probe = functools.partial(store.check, [cancel_key(job_id)]) if is_driver else None
        runner._cancel_points = CancelPoints(
            store, job_id, rank=boot.rank, world_size=boot.world_size, probe=probe, every=runner.cancel_every
        )
        _run_job(runner, job_id, fill_tensors(skeleton, tensors), boot.rank, results)


def _driver_tensors(boot: RankBoot, shared: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Rank 0: a private copy of the caller's tensors (CPU), or the tensors broadcast to the others (GPU)."""
    if device.type == "cpu":
        return [_private(t) for t in shared]
    tensors = [t.to(device).contiguous() for t in shared]
    if boot.world_size > 1:
        for t in tensors:
            dist.broadcast(t, src=DRIVER_RANK)
    return tensors


def _receive_tensors(boot: RankBoot, job_id: int, skeleton: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    """Rank r > 0: the job's top-level tensors, by the path of this device kind (module docstring)."""
    specs = placeholders(skeleton)
    if not specs:
        return []  # the controller wrote nothing for this job
    if device.type == "cpu":
        assert boot.channels.tensors is not None
        return _receive_shared(boot.channels.tensors, job_id)
    tensors = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in specs]
    for t in tensors:
        dist.broadcast(t, src=DRIVER_RANK)
    return tensors


def _receive_shared(channel: Channel, job_id: int) -> list[torch.Tensor]:
    """CPU fleets: map the caller's shared-memory tensors and take a private copy.

    Measured on the 2-core CI machine (bench/controller.py): a memcpy from shared memory on every rank is
    faster than relaying through rank 0 with a gloo broadcast, and the copy keeps ranks from seeing each
    other's (or the caller's) in-place edits.
    """
    got_id, shared = channel.get()
    if got_id != job_id:
        raise RuntimeError(f"MGPU fleet desync: tensors for job {got_id} arrived during job {job_id}")
    return [_private(t) for t in shared]


def _private(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _take_job(jobs: Channel) -> Job | None:
    while True:
        try:
            return jobs.get(timeout=3600.0)
        except queue.Empty:
            continue


def _run_job(runner: MGPURunner, job_id: int, kwargs: dict[str, Any], rank: int, results: Channel) -> None:
    """Advance the runner's generator, forwarding yields; whatever the render raises ends the job (a
    terminal `RunnerError`), unless it is a fleet-level fault (`fleet_fault`), which ends the rank.

    Argument binding and the generator check happen on every rank identically and before the runner
    touches any collective, so they are safe to report as `RunnerError` (symmetric) rather than fatal.
    """

    def send(kind: MessageKind, value: Any) -> None:
        results.put(Result(kind=kind, job_id=job_id, rank=rank, value=value))

    try:
        gen = runner(**kwargs)
    except BaseException as err:
        if fleet_fault(err):
            raise
        error = job_error(err, rank, job_id)
    else:
        if not isinstance(gen, Iterator):
            msg = f"{type(runner).__name__}.__call__ must be a generator (got {type(gen).__name__})"
            send(MessageKind.ERROR, RunnerError(msg))
            return
        while True:
            try:
                value = next(gen)
            except StopIteration as stop:
                send(MessageKind.DONE, stop.value)
                return
            except BaseException as err:
                if fleet_fault(err):
                    raise
                error = job_error(err, rank, job_id)
                break
            send(MessageKind.YIELD, value)
        del gen  # (finished: its frame, and the tensors it held, go with it)
    kwargs.clear()  # the job's own tensors too (a dict `_job_loop` built for this call alone)
    if isinstance(error, RenderFault):
        _release_memory(runner, oom=isinstance(error, RenderOutOfMemory))
    send(MessageKind.ERROR, error)


def _release_memory(runner: MGPURunner, oom: bool = False) -> None:
    """After a job that raised: collect what its frames held and hand cached device memory back, so an
    out-of-memory job leaves the next one the memory it had; after one (`oom`), log what still holds memory
    (`memory_report`)."""
    gc.collect()
    with contextlib.suppress(Exception):
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
    if oom and runner.device.type == "cuda":  # what the release could not free: the resident set, or a leak
        try:
            log.warning("after the out-of-memory job: %s", live_memory_report(runner.device))
        except Exception as exc:  # a report must never turn a job error into a fleet fault
            log.warning("after the out-of-memory job: no memory report (%s)", exc)


def _teardown(device: torch.device) -> None:
    # Compiled artifacts hold CUDA pool/stream references that process-group destruction waits on;
    # reset Dynamo first or teardown can deadlock.
    if "torch._dynamo" in sys.modules:
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def check_job_kwargs(runner_cls: type[MGPURunner], kwargs: dict[str, Any]) -> None:
    """Bind job kwargs to `runner_cls.__call__` in the caller, so a typo is a `TypeError` here rather than
    a failed job (and never a dead fleet)."""
    try:
        sig = inspect.signature(runner_cls.__call__)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, **kwargs)
    except TypeError as err:
        raise TypeError(f"invalid job kwargs for {runner_cls.__name__}: {err}") from None
