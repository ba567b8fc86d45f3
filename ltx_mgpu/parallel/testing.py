"""`LocalWorld`: a small pool of W processes joined in one process group, reused across many test calls.

Tests of the data plane (partitioning, all2all backends, SP numerics, the kernel backend) need real
process groups but not the controller; spawning a world once per module and sending it functions keeps
them fast (a spawn costs ~1-2 s per rank on a 2-core CI machine). Functions travel with cloudpickle by
value, so helpers defined in a test module work in the children.

    with LocalWorld(2) as world:                       # gloo on CPU
        results = world.run(fn, arg1, arg2)            # fn(ctx, arg1, arg2) on every rank -> list by rank
    LocalWorld(4, devices=["cuda:0"] * 4)              # 4 ranks oversubscribed on one GPU (gloo)

Every wait has a deadline and checks the children are alive. A rank that raises makes `run` raise
`WorldError` carrying every rank's traceback; the world is then closed (peers may be stuck in a collective)
and must be recreated (`LocalWorld.healthy` says whether it can still be used).
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import LtxMgpuError
from ..os_limits import raise_open_files_limit

__all__ = ["LocalWorld", "WorldContext", "WorldError", "WorldPool"]


@dataclass(frozen=True)
class WorldContext:
    """What a function run by `LocalWorld.run` receives as its first argument."""

    rank: int
    world_size: int
    device: torch.device  #: given by the caller per rank; never derived from the rank
    backend: str  #: process-group backend ("gloo" or "nccl")
    cache: dict[str, Any] = field(default_factory=dict)  #: per-rank state that survives between `run` calls


class WorldError(LtxMgpuError, RuntimeError):
    """A rank raised (or died, or timed out) during `LocalWorld.run`."""


def _worker(
    rank: int, world_size: int, device: str, backend: str, port: int, jobs: Any, results: Any, threads: int
) -> None:  # child process entry point
    from ..control.devices import MULTICAST_OFF_ENV

    for key, value in MULTICAST_OFF_ENV.items():  # as in fleet ranks: no NVLink multicast
        os.environ.setdefault(key, value)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # held by the parent
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        results.put((rank, "ready", None))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    ctx = WorldContext(rank=rank, world_size=world_size, device=dev, backend=backend)
    try:
        while True:
            payload = jobs.get()
            if payload is None:
                break
            try:
                fn, args, kwargs = cloudpickle.loads(payload)
                results.put((rank, "ok", fn(ctx, *args, **kwargs)))
            except BaseException:
                results.put((rank, "error", traceback.format_exc()))
    finally:
        if "torch._dynamo" in sys.modules:  # compiled artifacts can hold references that block teardown
            torch._dynamo.reset()
        dist.destroy_process_group()


class LocalWorld:
    """W spawned processes in one process group; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        devices: Sequence[str | torch.device] | None = None,
        backend: str = "gloo",
        timeout: float = 120.0,
        threads_per_rank: int | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        devices = ["cpu"] * world_size if devices is None else [str(d) for d in devices]
        if len(devices) != world_size:
            raise ValueError(f"need {world_size} devices, got {devices}")
        if threads_per_rank is None:
            # 1 (ranks share the cores) unless OMP_NUM_THREADS asks otherwise: scripts/test-numerics.sh
            # runs the numerics tests at 1 and 2 threads, since the thread count picks MKL's kernels.
            threads_per_rank = int(os.environ.get("OMP_NUM_THREADS") or 1)
        self.world_size = world_size
        self.devices = devices
        self.backend = backend
        self.timeout = timeout
        raise_open_files_limit()  # (results come back as tensors, one file descriptor per storage in flight)
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        # The rendezvous store lives in this process, bound before any rank starts (as the controller's
        # does): a port picked free and bound later by rank 0 can be taken in between (seen on a GPU host,
        # where NCCL opens ephemeral sockets: EADDRINUSE in init_process_group).
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
        )
        port = int(self._store.port)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, devices[r], backend, port, self._jobs[r], self._results, threads_per_rank),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.healthy = True
        try:
            self._collect(timeout)
        except BaseException:
            self.close()
            raise

    # ---- running -------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run `fn(ctx, *args, **kwargs)` on every rank; return the per-rank results in rank order."""
        if not self.healthy:
            raise WorldError("LocalWorld is closed (a previous call failed); create a new one")
        module = sys.modules.get(getattr(fn, "__module__", ""), None)
        if module is not None and module.__name__ not in ("__main__",) and not module.__name__.startswith("ltx_mgpu"):
            cloudpickle.register_pickle_by_value(module)  # test modules are not importable in children
        payload = cloudpickle.dumps((fn, args, kwargs))
        for q in self._jobs:
            q.put(payload)
        return self._collect(self.timeout if timeout is None else timeout)

    def _collect(self, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(got) + len(errors) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=0.05)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead and not errors:
                    self._fail(f"rank(s) {dead} exited (codes {[self._procs[r].exitcode for r in dead]})")
                if errors and time.monotonic() > min(deadline, self._first_error_at + 5.0):
                    break  # peers of a failed rank are likely stuck in a collective
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in got and r not in errors]
                    self._fail(f"timed out after {timeout:.0f}s waiting for ranks {missing}", errors)
                continue
            if status == "error":
                if not errors:
                    self._first_error_at = time.monotonic()
                errors[rank] = value
            else:
                got[rank] = value
        if errors:
            self._fail("rank(s) raised", errors)
        return [got[r] for r in range(self.world_size)]

    _first_error_at = 0.0

    def _fail(self, message: str, errors: dict[int, str] | None = None) -> None:
        self.close()
        detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted((errors or {}).items()))
        raise WorldError(message + detail)

    # ---- teardown ------------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """Ask every rank to leave (non-blocking), so several worlds can wind down concurrently."""
        if self.healthy and not self._closing:
            self._closing = True
            for q in self._jobs:
                try:
                    q.put(None)
                except Exception:
                    pass

    _closing = False

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (graceful, then terminate, then kill); idempotent, never raises."""
        self.begin_close()
        was_healthy, self.healthy = self.healthy, False
        deadline = time.monotonic() + (timeout if was_healthy else 0.5)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorldPool:
    """One `LocalWorld` per world size, made on first use and remade when a failure closed it; a test
    module keeps one pool and closes it at teardown (all worlds wind down concurrently)."""

    def __init__(self, **world_kwargs: Any) -> None:
        self.world_kwargs = world_kwargs
        self._worlds: dict[int, LocalWorld] = {}

    def get(self, size: int) -> LocalWorld:
        world = self._worlds.get(size)
        if world is None or not world.healthy:
            world = self._worlds[size] = LocalWorld(size, **self.world_kwargs)
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.begin_close()
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
