"""What a render's unexpected errors do to a fleet (on CPU ranks).

Before, only `RunnerError`/`ValueError` raised in a render were recoverable: an `OverflowError` (a request at
1e-300 fps), a `TypeError`, a `RuntimeError` or `torch.OutOfMemoryError` killed the rank and the fleet was
rebuilt. Now every error that is not a fleet-level fault ends the job (`RenderFault`), the fleet stays up
with the same processes and takes the next job; an out-of-memory job gives its memory back first. Raised
on some ranks only while the others wait in a collective, the fleet is poisoned after `error_settle_s`
(only killing the waiting ranks unblocks them) instead of hanging until the job's timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ltx_mgpu import (
    AsymmetricRunnerError,
    FleetFailure,
    MGPUController,
    RenderFault,
    RenderOutOfMemory,
    SymmetricRunnerError,
)
from ltx_mgpu.control.rank_faults import fleet_fault
from tests.support.controller_runners import ScriptedRunner

pytestmark = pytest.mark.timeout(300)

SETTLE_S = 3.0


@pytest.fixture(scope="module")
def fleet():
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"], error_settle_s=SETTLE_S)
    ctl.start(timeout=120)
    yield ctl
    ctl.shutdown(graceful_timeout=10)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize(
    ("error", "exc_type"),
    [("oom", "OutOfMemoryError"), ("type", "TypeError"), ("runtime", "RuntimeError"), ("overflow", "OverflowError")],
)
def test_an_unexpected_error_on_every_rank_ends_the_job_not_the_fleet(fleet, error, exc_type):
    pids = fleet.pids
    with pytest.raises(SymmetricRunnerError) as info:
        list(fleet.stream(mode="raise", error=error))
    errors = info.value.errors
    assert [type(e) for e in errors] == [RenderOutOfMemory if error == "oom" else RenderFault] * 2
    assert all(e.exc_type == exc_type for e in errors)
    assert str(info.value) == f"{exc_type}: injected {error} on rank 0"
    assert info.value.out_of_memory is (error == "oom")
    assert "Traceback" not in str(info.value)  # (the traceback stays in the rank's log)
    # the same processes take the next job
    assert fleet.is_alive and fleet.pids == pids
    assert [x for x in fleet.stream(mode="ok", n=1)] and fleet.pids == pids


def test_a_real_cpu_allocation_failure_is_an_out_of_memory_error(fleet):
    """On CPU ranks torch reports a failed allocation as a `RuntimeError` ("DefaultCPUAllocator: can't
    allocate memory"): it was a `RenderFault` (`runner_error`, never retried) instead of an out-of-memory job."""
    pids = fleet.pids
    with pytest.raises(SymmetricRunnerError) as info:
        list(fleet.stream(mode="alloc"))
    assert info.value.out_of_memory and all(isinstance(e, RenderOutOfMemory) for e in info.value.errors)
    assert "can't allocate memory" in str(info.value)
    assert list(fleet.stream(mode="ok", n=1)) and fleet.pids == pids


def test_an_out_of_memory_job_gives_its_memory_back(fleet):
    pids = fleet.pids
    before = _rss_mb(pids[0])
    stream = fleet.stream(mode="hog", hog_mb=400, sleep_s=3.0)
    assert [next(stream)["held"], next(stream)["held"]] == [400 << 18] * 2  # (yielded while holding it)
    assert _rss_mb(pids[0]) - before > 300
    with pytest.raises(SymmetricRunnerError) as info:
        next(stream)
    assert info.value.out_of_memory
    # The frames of the failed render (its traceback) no longer hold the tensor: the memory is back.
    assert _rss_mb(pids[0]) - before < 200, (before, _rss_mb(pids[0]))
    assert list(fleet.stream(mode="ok", n=1)) and fleet.pids == pids


def test_an_error_on_one_rank_while_the_other_finishes_is_asymmetric_and_the_fleet_stays(fleet):
    pids = fleet.pids
    with pytest.raises(AsymmetricRunnerError) as info:
        list(fleet.stream(mode="raise", error="type", raise_on=[1], n=0))
    assert isinstance(info.value.terminals[1], RenderFault) and isinstance(info.value.terminals[0], StopIteration)
    time.sleep(SETTLE_S + 0.5)  # (the job has ended: the settle time must not poison it afterwards)
    assert fleet.is_alive and fleet.pids == pids
    assert list(fleet.stream(mode="ok", n=1))


def test_an_error_on_one_rank_while_the_other_waits_in_a_collective_poisons_after_the_settle_time():
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"], error_settle_s=SETTLE_S)
    ctl.start(timeout=120)
    try:
        t0 = time.monotonic()
        with pytest.raises(FleetFailure) as info:
            list(ctl.stream(mode="raise", error="oom", raise_on=[1], timeout=120))
        took = time.monotonic() - t0
        assert info.value.reason == "split" and info.value.rank == 0, info.value
        assert "rank(s) [1] ended it with an error (OutOfMemoryError: injected oom on rank 1)" in str(info.value)
        assert SETTLE_S <= took < SETTLE_S + 30, took  # the settle time, not the job's 120 s timeout
        assert not ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=0)


@pytest.mark.parametrize(
    ("error", "fatal"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 115.00 GiB"), False),
        (TypeError("unsupported operand"), False),
        (OverflowError("cannot convert float infinity to integer"), False),
        (RuntimeError("shape mismatch"), False),
        (KeyError("x"), False),
        (ValueError("NCCL in a ValueError is still the request's"), False),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (dist.DistNetworkError("Connection reset by peer"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), True),
        (SystemExit(1), True),
        (KeyboardInterrupt(), True),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_which_errors_are_fleet_level_faults(error, fatal):
    """Sticky device errors and broken communicators end the rank (the fleet is rebuilt); everything else
    a render raises ends only the job."""
    assert fleet_fault(error) is fatal
