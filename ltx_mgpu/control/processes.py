"""The caller's side of the rank processes: spawning one generation of them, noticing exits, killing them.

`FleetProcesses` is one generation of rank processes and their channels; `MGPUController` replaces it on
every `start()` and never reuses one. `spawn_fleet` starts the ranks (`fleet.rank_main` runs inside each),
`await_ready` blocks until every rank has run `setup()`, `exited_rank_failure` turns exited ranks into the
`FleetFailure` that poisons the controller. Job semantics (dispatch, results, classification) live in
`controller.py` and `stream.py`; the rank side is `fleet.py`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import FleetFailure, FleetTimeoutError
from .fleet import FleetChannels, RankBoot, rank_main, ship_runner
from .runner import MGPURunner
from .startup import RankStartup
from .transport import MessageKind, Waker, receive_any

__all__ = ["FleetProcesses", "await_ready", "exited_rank_failure", "spawn_fleet"]

#: The longest path a Unix socket can have (Linux `sun_path`: 108 bytes with its NUL).
_SUN_PATH_MAX = 107
#: What goes below the system's temporary directory before a rank's fd-sharing socket: the scratch directory
#: (`/ltxf-XXXXXXXX`), then multiprocessing's own (`/pymp-XXXXXXXX`) and its listener (`/listener-XXXXXXXX`).
_SOCKET_TAIL = len("/ltxf-XXXXXXXX/pymp-XXXXXXXX/listener-XXXXXXXX")


def _scratch_base() -> str | None:
    """Where the fleet's scratch directory goes: the system's temporary directory, unless a rank's socket
    path would not fit below it (a deep `TMPDIR`, as pytest's or a container's can be). A rank that yields
    a tensor then failed with `OSError: AF_UNIX path too long` and took the fleet down. A short standard
    folder is used instead; the controller removes the scratch directory at every teardown either way."""
    if len(tempfile.gettempdir()) + _SOCKET_TAIL <= _SUN_PATH_MAX:
        return None
    for short in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            return short
    return None  # (nothing shorter to offer: the failure names the cause)


def _fit_callers_socket_dir() -> None:
    """The caller's side of the same limit: tensor kwargs are shared with the driver rank through a socket
    below multiprocessing's temporary directory of this process. Under a deep `TMPDIR` that directory is made
    in a short folder instead, the way newer Pythons do it themselves (3.11's `multiprocessing.util` does not:
    this reaches into its per-process config, and registers the same clean-up it would)."""
    from multiprocessing import process, util

    config = process.current_process()._config
    base = _scratch_base()
    if config.get("tempdir") is not None or base is None:
        return
    scratch = tempfile.mkdtemp(prefix="pymp-", dir=base)
    util.Finalize(None, util._remove_temp_dir, args=(shutil.rmtree, scratch), exitpriority=-100)
    config["tempdir"] = scratch


class FleetProcesses:
    """One generation of rank processes and their channels (replaced on every `start()`)."""

    def __init__(self, procs: list[Any], channels: FleetChannels, store: dist.TCPStore, scratch_dir: str) -> None:
        self.procs = procs
        self.channels = channels
        self.store = store
        self.scratch_dir = scratch_dir  # the ranks' temporary files (rank_main points tempfile here)
        self.waker = Waker()  # wakes the iterating thread when the fleet is poisoned

    def terminate(self, grace_s: float = 3.0) -> None:
        """SIGTERM, wait, SIGKILL, reap; then remove the ranks' scratch directory (a killed rank runs no exit
        handlers, so its temporary files are only removed here). Idempotent, never raises."""
        for p in self.procs:
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.kill()
                p.join(5.0)
        shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def close(self) -> None:
        """Close every pipe (after `terminate()`); idempotent."""
        for channel in self.channels.all():
            channel.close()
        self.waker.close()

    def all_exited(self) -> bool:
        return all(p.exitcode is not None for p in self.procs)


def spawn_fleet(
    ctx: Any,
    runner_cls: type[MGPURunner],
    devices: list[str],
    backend: str,
    timeout_s: float,
    setup_kwargs: dict[str, Any],
    deterministic: str,
    *,
    rank_logging: Callable[[int], None] | None = None,
) -> FleetProcesses:
    """Start one process per device (`fleet.rank_main`) and return them without waiting for them.

    A signal (the worker's startup interrupt) or a failed spawn between two ranks kills the ranks already
    running before it propagates: they belong to no `FleetProcesses` the caller could shut down yet, and the
    caller's exit would wait for them (multiprocessing joins its children at exit).
    """
    world_size = len(devices)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    channels = FleetChannels.create(ctx, devices)
    scratch_dir = tempfile.mkdtemp(prefix="ltxf-", dir=_scratch_base())
    _fit_callers_socket_dir()
    payload = ship_runner(runner_cls)
    procs: list[Any] = []
    try:
        for rank in range(world_size):
            boot = RankBoot(
                rank,
                world_size,
                devices,
                backend,
                store.port,
                timeout_s,
                payload,
                setup_kwargs,
                channels.for_rank(rank),
                scratch_dir,
                deterministic,
            )
            proc = ctx.Process(target=_rank_entry, args=(boot, rank_logging), name=f"ltx-mgpu-rank{rank}")
            procs.append(proc)  # (before start: a start interrupted half-way may have made the child)
            proc.start()
    except BaseException:
        half = FleetProcesses(procs, channels, store, scratch_dir)
        half.terminate(0.0)
        half.close()
        raise
    return FleetProcesses(procs, channels, store, scratch_dir)


def _rank_entry(boot: RankBoot, rank_logging: Callable[[int], None] | None) -> None:
    """Spawn target: the caller's logging first (`MGPUController(rank_logging=...)`), then `fleet.rank_main`.
    A logging setup that fails leaves Python's default and says so; the rank itself must not die of it."""
    if rank_logging is not None:
        try:
            rank_logging(boot.rank)
        except Exception as exc:
            sys.stderr.write(f"[ltx_mgpu rank {boot.rank}] rank_logging failed ({type(exc).__name__}: {exc})\n")
    rank_main(boot)


def await_ready(fleet: FleetProcesses, world_size: int, timeout_s: float) -> list[RankStartup]:
    """Wait for every rank's check-in, watching for crashes (exits) and wedges (the deadline)."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, RankStartup] = {}
    while len(seen) < world_size:
        failure = exited_rank_failure(fleet, during="startup")
        if failure is not None:
            raise failure
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(seen))
            raise FleetTimeoutError(
                f"MGPU startup: {len(seen)}/{world_size} workers ready after {timeout_s:.0f}s; "
                f"ranks {missing} never checked in -- stuck in init_process_group / group creation / "
                "setup()? Check the worker logs.",
                reason="timeout",
            )
        got = receive_any(fleet.channels.up, 0.05)
        if got is not None and got[1].kind is MessageKind.READY:
            stamp: RankStartup = got[1].value
            seen[stamp.rank] = stamp
    return list(seen.values())


def exited_rank_failure(fleet: FleetProcesses, *, during: str | None) -> FleetFailure | None:
    """The failure naming every exited rank with the traceback it reported (None while all are alive)."""
    exited = [(r, p) for r, p in enumerate(fleet.procs) if p.exitcode is not None]
    if not exited:
        return None
    tracebacks: dict[int, str] = {}
    # A crashing rank writes its traceback before exiting; collect what arrived (briefly).
    drain_until = time.monotonic() + 0.5
    while time.monotonic() < drain_until and not all(r in tracebacks for r, _ in exited):
        got = receive_any([fleet.channels.failures[r] for r, _ in exited], 0.05)
        if got is not None:
            tracebacks[got[1].rank] = got[1].traceback
        elif tracebacks or time.monotonic() > drain_until - 0.4:
            break
    where = f" during {during}" if during else ""
    lines = [f"MGPU worker(s) failed{where}:"]
    for rank, proc in exited:
        lines.append(f"  rank {rank} (pid {proc.pid}) exit {proc.exitcode}:")
        tb = tracebacks.get(rank)
        lines.append(_indent(tb) if tb else "    (no traceback: the process died without reporting)")
    rank0, proc0 = exited[0]
    return FleetFailure(
        "\n".join(lines),
        reason="rank_failed" if tracebacks else "rank_exited",
        rank=rank0,
        pid=proc0.pid,
        exitcode=proc0.exitcode,
    )


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
