"""The controller's pipes: every tensor path is read, and no read or write can block the caller forever.

Regression: top-level tensor kwargs on a CPU fleet were written to a per-rank channel that no
rank read, so the 64 KiB pipe filled after ~176 jobs and `stream()` blocked forever inside `write()`.
"""

from __future__ import annotations

import fcntl
import io
import multiprocessing
import os
import pickle
import queue
import resource
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from ltx_mgpu import MGPUController
from ltx_mgpu.control.transport import Channel, ChannelClosed, ChannelTimeout
from tests.support.controller_runners import ScriptedRunner

_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)  # (Linux; the constant is in fcntl from Python 3.10)


def _kwargs(j: int) -> dict[str, object]:
    """Job `j`'s tensor kwargs: fresh tensors per job, so stale deliveries would show in the sums."""
    return {"x": torch.full((4,), float(j)), "nested": {"t": torch.full((5,), float(j % 7))}}


def _jobs_that_fill_an_unread_pipe() -> int:
    """Jobs after which a pipe nobody reads is full, if each job wrote nothing but its tensor kwargs to it,
    framed as `Channel.put` frames them (a real job's message carries more, so it jams sooner)."""
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(_kwargs(0))
    reader, writer = os.pipe()
    try:
        capacity = fcntl.fcntl(writer, _F_GETPIPE_SZ)
    finally:
        os.close(reader)
        os.close(writer)
    return -(-capacity // (4 + len(buf.getvalue())))


def _run_jobs(ctl: MGPUController, world: int, jobs: int, progress: list[int], failures: list[str]) -> None:
    for j in range(jobs):
        items = list(ctl.stream(mode="tensors", **_kwargs(j)))
        sums = sorted(item["x_sum_all_ranks"] for item in items)
        nested_sums = sorted(item["nested_sum"] for item in items)
        if sums != [world * 4.0 * j] * world or nested_sums != [5.0 * (j % 7)] * world:
            failures.append(f"job {j}: x sums {sums}, nested sums {nested_sums}")
            return
        progress[0] = j + 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_jobs_with_tensor_kwargs_never_jam(world: int) -> None:
    """Three times the jobs that would fill an unread per-rank pipe (~154 at 64 KiB; the regression jammed
    at ~176): a channel that no rank reads jams within the first third of the run."""
    jobs = 3 * _jobs_that_fill_an_unread_pipe()
    ctl = MGPUController(ScriptedRunner, devices=["cpu"] * world)
    ctl.start(timeout=120)
    progress, failures = [0], []
    worker = threading.Thread(target=_run_jobs, args=(ctl, world, jobs, progress, failures), daemon=True)
    try:
        worker.start()
        # Generous (a job takes ~5 ms here, ~60 ms on a loaded machine): the check is "it finishes", and a jam
        # never finishes at all. Progress is checked so a stall is reported at once with where it stopped.
        deadline = time.monotonic() + 420
        last, last_move = -1, time.monotonic()
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(1.0)
            if progress[0] != last:
                last, last_move = progress[0], time.monotonic()
            elif time.monotonic() - last_move > 90:
                break
        assert not worker.is_alive(), f"jammed: the caller is stuck after {progress[0]} of {jobs} jobs"
        assert not failures, failures
        assert progress[0] == jobs
        assert ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=5)  # also unblocks a stuck writer (its pipe breaks)


# ==== Channel: bounded writes and reads ==========================================================


@pytest.fixture
def channel():
    ch = Channel(multiprocessing.get_context("spawn"))
    yield ch
    ch.close()


def _fill(ch: Channel) -> int:
    """Write until the pipe is full; returns how many messages fit."""
    n = 0
    while True:
        try:
            ch.put(b"x" * 1000, timeout=0)
        except ChannelTimeout:
            return n
        n += 1


def test_put_on_a_pipe_nobody_reads_times_out(channel: Channel) -> None:
    # How many fit depends on the machine's pipe (64 KiB by default with 4 KiB pages, 1 MiB with 64 KiB pages,
    # one page for a user over pipe-user-pages-soft): at least one frame per page, at most the bytes' worth.
    capacity = fcntl.fcntl(channel._writer.fileno(), _F_GETPIPE_SZ)
    frame = 4 + len(pickle.dumps(b"x" * 1000, pickle.HIGHEST_PROTOCOL))
    assert min(capacity // resource.getpagesize(), capacity // frame) <= _fill(channel) <= capacity // frame
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout, match="room in the pipe"):
        channel.put({"big": b"y" * 100_000}, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5


def test_put_gives_up_when_the_reader_is_no_longer_alive(channel: Channel) -> None:
    _fill(channel)
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    with pytest.raises(ChannelClosed, match="no longer alive"):
        channel.put(b"z", alive=lambda: not flag.is_set())


def test_put_waits_for_a_reader_that_makes_room(channel: Channel) -> None:
    n = _fill(channel)
    got: list[object] = []

    def drain() -> None:
        time.sleep(0.2)
        for _ in range(n + 1):
            got.append(channel.get(timeout=5))

    reader = threading.Thread(target=drain)
    reader.start()
    channel.put(("last", torch.arange(3)), timeout=10)
    reader.join(10)
    assert got[-1][0] == "last" and got[-1][1].tolist() == [0, 1, 2]


def test_get_of_a_half_written_message_gives_up_when_the_writer_is_dead(channel: Channel) -> None:
    import os
    import struct

    os.write(channel._writer.fileno(), struct.pack("!i", 100) + b"only part of it")
    dead = threading.Event()
    threading.Timer(0.2, dead.set).start()
    with pytest.raises(ChannelClosed, match="rest of a message"):
        channel.get(timeout=1, alive=lambda: not dead.is_set())
    with pytest.raises(queue.Empty):
        Channel(multiprocessing.get_context("spawn")).get(timeout=0.05)


def test_a_rank_yields_tensors_under_a_deep_tmpdir(tmp_path, monkeypatch) -> None:
    """Regression (the demo under pytest's TMPDIR): a rank shares a yielded tensor through a Unix socket that
    multiprocessing makes below the rank's temporary directory; below a deep TMPDIR its path passed the
    108-byte limit and the rank died (`OSError: AF_UNIX path too long`), taking the fleet down."""
    import tempfile

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=120, scale=2.0)
    try:
        x = torch.arange(1 << 16, dtype=torch.float32)  # (large enough to be shared, not pickled inline)
        items = list(ctl.stream(mode="tensors", x=x, nested={"t": torch.ones(5)}))
        assert len(items) == 2 and all(torch.equal(item["scaled"], x * 2.0) for item in items)
        assert ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=10)
    assert not any(deep.iterdir())  # (the scratch directory went elsewhere and is gone)


def test_a_start_interrupted_between_two_spawns_leaves_no_rank_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI (2 loaded cores): a worker SIGTERMed during its fleet start hung at exit. The interrupt landed
    while the ranks were being spawned, before they formed a fleet `shutdown()` can see, and interpreter
    exit waited for the orphaned rank (multiprocessing joins its children). Here the second spawn is
    interrupted: the first rank must be gone when `start()` raises, and the controller startable again."""
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"])
    real_process = ctl._ctx.Process
    started = []

    def process(*args, **kwargs):
        proc = real_process(*args, **kwargs)
        if started:  # the second rank: the signal arrives here
            raise KeyboardInterrupt
        started.append(proc)
        return proc

    monkeypatch.setattr(ctl._ctx, "Process", process)
    with pytest.raises(KeyboardInterrupt):
        ctl.start(timeout=60)
    assert started and started[0].exitcode is not None, "the first rank was left running"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("ltx-mgpu-rank")]
    assert ctl.pids == [] and not ctl.is_alive
    monkeypatch.undo()
    ctl.start(timeout=120)
    try:
        assert len(ctl.pids) == 2
    finally:
        ctl.shutdown(graceful_timeout=10)
