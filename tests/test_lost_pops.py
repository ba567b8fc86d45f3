"""A job whose id a lost BLPOP reply took off every list is found and queued again (`worker.rq.loop.lost_pops`).

An idle worker serving several queues waits with BLPOP; if Redis ran it and the reply never arrived, the id was
in no list and the job stayed `queued` forever (redis-py even re-sent the BLPOP and hid the error). The sweep's
rules against a real Redis, then the whole thing through a proxy that drops exactly that reply to a real worker."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from devstack.tcp_proxy import TcpProxy
from ltx_contract.keys import REFUSALS_KEY, RENDER_FUNC
from ltx_contract.states import FailureReason
from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, enqueue, events, meta_state, wait_ready, wait_state, worker_env
from worker.jobs.admission_rule import Refusal
from worker.rq.loop.lost_pops import (
    ENQUEUE_SLACK_S,
    MAX_PER_QUEUE,
    LostPops,
    Orphan,
    find_orphans,
    may_requeue,
    requeue_orphan,
)

pytestmark = pytest.mark.timeout(240)


def _queued(conn: Any, queue: Queue, prompt: str, **kwargs: Any) -> Any:
    """A job enqueued on `queue` (its hash `queued`, `enqueued_at` now), its id then taken off every list."""
    job = queue.enqueue(RENDER_FUNC, {"prompt": prompt}, **kwargs)
    conn.lrem(queue.key, 0, job.id)
    return job


def test_the_sweep_finds_only_queued_jobs_in_no_list(redis_client: Any) -> None:
    conn, name = redis_client, f"lp-{uuid.uuid4().hex[:6]}"
    queue, other = (Queue(n, connection=conn, serializer=JSONSerializer) for n in (name, name + "-other"))
    began = time.time()
    lost = _queued(conn, queue, "lost")
    waiting = queue.enqueue(RENDER_FUNC, {"prompt": "waiting"})  # in its queue
    taken = _queued(conn, queue, "taken")
    conn.rpush(queue.intermediate_queue_key, taken.id)  # taken by a worker (RQ's intermediate list)
    refused = _queued(conn, queue, "refused")
    conn.rpush(REFUSALS_KEY, Refusal(refused.id, name, FailureReason.QUEUE_FULL).to_json())
    ended = _queued(conn, queue, "ended")
    conn.hset(ended.key, "status", "finished")
    old = _queued(conn, queue, "old")  # enqueued long before the wait began: not what it took
    conn.hset(old.key, "enqueued_at", "2020-01-01T00:00:00.000000Z")
    elsewhere = _queued(conn, other, "elsewhere")  # a queue the wait was not on
    conn.sadd(f"rq:job:{lost.id}:dependents", "x")  # (not a hash: skipped)
    try:
        found = find_orphans(conn, [name], began - ENQUEUE_SLACK_S)
        assert [o.job_id for o in found] == [lost.id] and found[0].origin == name
        assert {waiting.id, taken.id, refused.id, ended.id, old.id, elsewhere.id}.isdisjoint(o.job_id for o in found)
    finally:
        conn.delete(REFUSALS_KEY)


def test_a_sweep_puts_the_job_back_at_the_head_once_and_leaves_a_moved_one(redis_client: Any) -> None:
    conn, name = redis_client, f"lp-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    lost = _queued(conn, queue, "lost")
    behind = queue.enqueue(RENDER_FUNC, {"prompt": "pushed after it"})
    pops = LostPops(confirm_s=0)
    pops.suspect([name], time.time() - 1)
    assert pops.pending and pops.sweep(conn) == [lost.id] and not pops.pending
    assert conn.lrange(queue.key, 0, -1) == [lost.id.encode(), behind.id.encode()]
    assert pops.sweep(conn) == []  # (nothing pending)
    pops.suspect([name], time.time() - 1)
    assert pops.sweep(conn) == []  # (it is in its queue now)
    assert conn.lrange(queue.key, 0, -1) == [lost.id.encode(), behind.id.encode()]
    # between the search and the re-queue the id was submitted again (a new `created_at`): left alone
    moved = _queued(conn, queue, "moved")
    orphan = Orphan(moved.id, name, conn.hget(moved.key, "created_at"))
    conn.hset(moved.key, "created_at", "2030-01-01T00:00:00.000000Z")
    assert not requeue_orphan(conn, orphan)
    assert conn.lpos(queue.key, moved.id) is None


def test_hand_written_hashes_cost_a_sweep_a_bounded_share_per_queue(redis_client: Any) -> None:
    """A lost wait takes one id; a client that writes thousands of `queued` hashes it never pushes (its own
    queue, its own hashes) stalled the worker for a minute. Each queue gets its newest `MAX_PER_QUEUE` back."""
    conn, name = redis_client, f"lp-{uuid.uuid4().hex[:6]}"
    queue, other = (Queue(n, connection=conn, serializer=JSONSerializer) for n in (name, name + "-b"))
    began = time.time()
    flood = [_queued(conn, queue, f"forged {i}") for i in range(MAX_PER_QUEUE + 5)]
    for i, job in enumerate(flood):  # (distinct enqueue times: the newest are the last ones)
        conn.hset(job.key, "enqueued_at", f"2099-01-01T00:00:{i:02d}.000000Z")
    lost = _queued(conn, other, "the real one, on another queue")
    found = find_orphans(conn, [name, other.name], began - ENQUEUE_SLACK_S)
    assert sorted(o.job_id for o in found if o.origin == name) == sorted(j.id for j in flood[-MAX_PER_QUEUE:])
    assert [o.job_id for o in found if o.origin == other.name] == [lost.id]


def test_a_sweep_over_many_hashes_is_bounded_and_continues_where_it_stopped(redis_client: Any) -> None:
    """A tenant's key count made one sweep scan all of them (22 s over 200k hashes). Each sweep scans a bounded
    slice and keeps the cursor; the lost job is found by a later sweep, and the sweep then ends."""
    conn, name = redis_client, f"lp-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    pipe = conn.pipeline(transaction=False)
    filler = [f"rq:job:fill-{name}-{i}" for i in range(20_000)]
    for key in filler:  # (hashes of ended jobs: scanned, never queued again)
        pipe.hset(key, mapping={"status": "finished", "origin": name})
    pipe.execute()
    lost = _queued(conn, queue, "lost among many")
    real_scan, scanned = conn.scan, [0]

    def counting_scan(*args: Any, **kwargs: Any) -> Any:
        cursor, keys = real_scan(*args, **kwargs)
        scanned[0] += len(keys)
        return cursor, keys

    try:
        conn.scan = counting_scan  # (this connection only: count the keys each sweep reads)
        pops = LostPops(confirm_s=0, max_keys=2_000, max_s=30)
        pops.suspect([name], time.time() - 1)
        sweeps, requeued = 0, []
        while pops.pending:
            scanned[0] = 0
            requeued += pops.sweep(conn)
            sweeps += 1
            assert scanned[0] < 2_000 + 3_000, scanned  # (the bound, plus one SCAN reply's worth: COUNT is a hint)
        assert requeued == [lost.id] and sweeps >= 5, sweeps  # (20,001 keys of this test alone, 2,000 a sweep)
        assert conn.lrange(queue.key, 0, -1) == [lost.id.encode()]
    finally:
        del conn.scan
        for i in range(0, len(filler), 5000):
            conn.delete(*filler[i : i + 5000])


def test_a_tenant_hash_never_reaches_a_queue_its_tenant_cannot_push_to() -> None:
    tenants = ["alice", "bob"]
    assert may_requeue("alice-1", "q:t:alice", tenants)
    assert not may_requeue("bob-1", "q:t:alice", tenants)  # another tenant's queue
    assert not may_requeue("plain", "q:t:alice", tenants)
    assert not may_requeue("alice-1", "q", tenants)  # the shared queue: operators' only
    assert may_requeue("ops-job", "q", tenants) and may_requeue("alice-1", "q", [])  # (no tenant queues)


@pytest.fixture
def proxied_worker(tmp_path: Path, redis_server: Any, s3_server: Any) -> Any:
    """An idle `ltx-worker one` serving two queues (so it waits with BLPOP), its Redis behind a proxy."""
    proxy = TcpProxy(redis_server.port).start()
    name, high = f"lp{uuid.uuid4().hex[:6]}", f"q-{uuid.uuid4().hex[:8]}"
    low = high + "-low"
    env = worker_env(f"redis://127.0.0.1:{proxy.port}/0", s3_server, queue=f"{high},{low}", name=name,
                     spool=tmp_path / "spool")  # fmt: skip
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp_path / "worker.log").start()
    conn = redis_server.client()
    try:
        wait_ready(conn, name, 1, 120, proc)
        yield proc, conn, proxy, low
    finally:
        assert proc.stop() == 0, proc.log_tail()
        conn.close()
        proxy.stop()


def test_a_job_whose_blpop_reply_was_lost_is_rendered(proxied_worker: Any) -> None:
    proc, conn, proxy, low = proxied_worker
    request = {"prompt": "t lost pop", "width": 64, "height": 64, "num_frames": 9}
    for attempt in range(5):  # (a push that lands between two waits is taken by the non-blocking scan: again)
        job_id = f"lost-{uuid.uuid4().hex[:8]}"
        proxy.drop_replies(0 if attempt else 1, after=b"BLPOP", containing=job_id.encode())
        time.sleep(1.5)  # (a wait armed: the worker's BLPOPs come in slices of a second)
        job = enqueue(conn, low, request, job_id=job_id)
        wait_for(lambda j=job: proxy.pending_drops == 0 or meta_state(j) in ("uploaded", "failed"), 60,
                 "the BLPOP reply carrying the job cut, or the job taken otherwise", poll=0.01)  # fmt: skip
        if proxy.pending_drops == 0:
            break
    else:
        pytest.fail("no BLPOP took any of five jobs")
    assert wait_state(job, {"uploaded", "failed"}, 60, proc) == "uploaded"
    assert [e["state"] for e in events(conn, job_id) if e["type"] == "state"].count("started") == 1
    assert "queued again at its head" in proc.log_tail(200_000)


def test_a_sweep_redis_refuses_is_given_up_without_stopping_the_worker() -> None:
    """A Redis user without SCAN: the worker logs it and goes on (an outage instead propagates, to be waited
    out with the sweep still pending)."""
    import redis

    from worker.runtime.fleet_worker import FleetWorker

    class Refusing:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def scan(self, *_: Any, **__: Any) -> Any:
            raise self.exc

    worker = FleetWorker.__new__(FleetWorker)
    worker.lost_pops = LostPops(confirm_s=0)
    worker.lost_pops.suspect(["q"], time.time())
    worker.connection = Refusing(redis.exceptions.NoPermissionError("this user has no permissions to run 'scan'"))
    worker._sweep_lost_pops()
    assert not worker.lost_pops.pending
    worker.lost_pops.suspect(["q"], time.time())
    worker.connection = Refusing(redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"))
    with pytest.raises(redis.exceptions.BusyLoadingError):
        worker._sweep_lost_pops()
    assert worker.lost_pops.pending
