"""Cancellation without a host rendezvous per step (`job_board.CancelPoints`): every rank takes the same
decision at the same call, rank 0 never waits for another rank, and no decision key outlives the next job.
A real TCPStore (in-process) for the unit contract; a two-rank CPU fleet for the end-to-end one."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from ltx_mgpu import JobCancelledError, MGPUController, MGPURunner
from ltx_mgpu.control.job_board import CancelPoints, cancel_key


@pytest.fixture()
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    yield s
    del s


def test_ranks_agree_even_when_the_flag_flips_between_their_reads(store: dist.TCPStore) -> None:
    flag = {"set": False}
    driver = CancelPoints(store, 7, rank=0, world_size=2, probe=lambda: flag["set"], every=1)
    other = CancelPoints(store, 7, rank=1, world_size=2)
    assert driver.check() is False  # call 0: rank 0 decides alone, the other rank has not arrived
    flag["set"] = True  # the caller cancels now...
    assert other.check() is False  # ...but call 0 was decided "go on": the other rank follows rank 0
    assert driver.check() is True  # call 1
    assert other.check() is True
    driver.cleanup()
    assert not any(store.check([f"{cancel_key(7)}/at/{i}"]) for i in range(2))


def test_only_every_nth_call_decides(store: dist.TCPStore) -> None:
    driver = CancelPoints(store, 8, rank=0, world_size=2, probe=lambda: True, every=3)
    other = CancelPoints(store, 8, rank=1, world_size=2, every=3)
    assert [driver.check() for _ in range(4)] == [True, False, False, True]
    assert [other.check() for _ in range(4)] == [True, False, False, True]
    # two decisions (calls 0 and 3), so two keys
    assert store.check([f"{cancel_key(8)}/at/1"]) and not store.check([f"{cancel_key(8)}/at/2"])
    driver.cleanup()


def test_keys_stay_bounded_when_a_job_polls_in_a_tight_loop(store: dist.TCPStore) -> None:
    """Thousands of decisions in one job (a runner polling in a loop): rank 0 deletes what every rank has
    read, so the store never holds more than a few batches of keys; the next job's cleanup takes the rest."""
    own = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    n = 20 * CancelPoints.ACK_EVERY
    driver = CancelPoints(store, 10, rank=0, world_size=2, probe=lambda: False)
    other = CancelPoints(own, 10, rank=1, world_size=2)
    most, batch = 0, 100  # rank 0 runs a batch ahead, then the other rank catches up: deterministic
    for _ in range(n // batch):
        assert not any(driver.check() for _ in range(batch))
        most = max(most, store.num_keys())
        assert not any(other.check() for _ in range(batch))
    # never n keys: what both had read was deleted along the way (at most a batch plus two report periods)
    assert most <= batch + 2 * CancelPoints.ACK_EVERY + 2, most
    driver.cleanup()
    assert not any(store.check([f"{cancel_key(10)}/at/{i}"]) for i in range(n))
    assert not store.check([f"{cancel_key(10)}/read/1"])


def test_a_rank_that_arrives_first_waits_for_the_driver_only(store: dist.TCPStore) -> None:
    own = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    other = CancelPoints(own, 9, rank=1, world_size=2)  # its own connection, as a rank process has
    got: list[bool] = []
    reader = threading.Thread(target=lambda: got.append(other.check()))
    reader.start()
    time.sleep(0.2)
    assert not got  # still waiting: rank 0 has not decided call 0
    CancelPoints(store, 9, rank=0, world_size=2, probe=lambda: True).check()
    reader.join(timeout=10)
    assert got == [True]


class PacedRunner(MGPURunner):
    """Each rank sleeps its own time per step: rank 1 is slow."""

    def setup(self) -> None:
        pass

    def __call__(self, *, n: int, slow_s: float) -> Iterator[dict[str, Any]]:
        for step in range(n):
            self.raise_if_cancelled()
            time.sleep(slow_s if self.rank == 1 else 0.0)
            yield {"step": step, "rank": self.rank, "t": time.monotonic()}
        return "completed"


def test_the_driver_is_not_held_to_the_slowest_rank_and_cancel_still_lands() -> None:
    """A gloo broadcast per step would pace rank 0 at rank 1's 0.1 s a step; without it rank 0 finishes its
    eight steps long before rank 1. A cancel still ends the job on both ranks and the fleet lives on."""
    ctl = MGPUController(PacedRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=120)
    try:
        events = list(ctl.stream(n=8, slow_s=0.1))
        last = {e["rank"]: e["t"] for e in events if isinstance(e, dict)}
        assert last[1] - last[0] > 0.4, last  # rank 1 needs 0.8 s; rank 0 did not wait for it
        stream = ctl.stream(n=10_000, slow_s=0.01)
        next(stream)
        threading.Timer(0.05, stream.cancel).start()
        with pytest.raises(JobCancelledError):
            for _ in stream:
                pass
        assert ctl.is_alive
        assert list(ctl.stream(n=2, slow_s=0.0))  # the next job is not cancelled
    finally:
        ctl.shutdown(graceful_timeout=10)
