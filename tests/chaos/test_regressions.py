"""Regression tests for defects the chaos suite found, each against the real thing (Redis, SeaweedFS, a real
`ltx-worker one` process with a CPU fleet). The full chaos run (test_chaos.py) covers them too; these pin
each one down in isolation and fast."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tests.chaos.hostile import VALID, canary_paths, raw_job_hashes
from tests.test_worker_support import (
    WorkerProcess,
    enqueue,
    wait_for,
    wait_ready,
    wait_state,
    worker_env,
)
from worker.keys import RENDER_FUNC
from worker.renderjob import RefusedJob, RenderJob

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("regress")
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"r{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=tmp / "spool")
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp / "worker.log").start()
    conn = redis_server.client()
    wait_ready(conn, name, 1, 120, proc)
    try:
        yield proc, conn, queue, name, tmp
    finally:
        assert proc.stop() == 0, proc.log_tail()
        conn.close()


def test_render_job_refuses_other_functions(redis_client: Any, tmp_path: Path) -> None:
    """A job naming any function but the render function is never executed (it used to run os.makedirs)."""
    target = tmp_path / "pwned"
    job = RenderJob.create("os.makedirs", args=(str(target),), connection=redis_client, serializer=JSONSerializer)
    with pytest.raises(RefusedJob):
        job.perform()
    assert not target.exists()


def test_hostile_job_hashes_fail_without_killing_the_worker_or_running_anything(one_worker: Any) -> None:
    """Hand-written job hashes (garbage data, another function, wrong arguments, bad timestamps, corrupt
    meta) used to make the worker quit (and drop its warm fleet) or run arbitrary functions; now each one
    fails (or, without a data field, is skipped by RQ) and the same worker and fleet then render a job."""
    proc, conn, queue, name, tmp = one_worker
    before = wait_ready(conn, name, 1, 60, proc)[0]
    canary = tmp / "canary"
    canary.mkdir(exist_ok=True)
    hashes = raw_job_hashes(queue, canary)
    for _, job_id, fields in hashes:
        conn.hset(f"rq:job:{job_id}", mapping=fields)
        conn.rpush(f"rq:queue:{queue}", job_id)
    conn.sadd("rq:queues", f"rq:queue:{queue}")
    ok = enqueue(conn, queue, dict(VALID, prompt="t"))
    assert wait_state(ok, {"uploaded", "failed"}, 60, proc) == "uploaded"
    for label, job_id, fields in hashes:
        status = conn.hget(f"rq:job:{job_id}", "status")
        assert conn.lpos(f"rq:queue:{queue}", job_id) is None
        if "data" in fields:  # without data RQ treats the hash as no job at all (its own cleanup drops the id)
            assert status == b"failed", (label, status)
            assert conn.lpos(f"rq:queue:{queue}:intermediate", job_id) is None
    assert canary_paths(canary) == []
    after = wait_ready(conn, name, 1, 60, proc)[0]
    assert after["pid"] == before["pid"] and after["fleet"]["pids"] == before["fleet"]["pids"]
    assert proc.proc is not None and proc.proc.poll() is None


def test_job_failing_before_the_service_runs_gets_a_terminal_state(one_worker: Any) -> None:
    """Arguments that do not fit render(request) used to leave meta `queued` while RQ said failed: a
    watcher never saw an end. Now the job's stream and summary end in `failed` (invalid_request)."""
    proc, conn, queue, _, _ = one_worker
    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    job = q.enqueue(RENDER_FUNC, VALID, "unexpected", meta={"state": "queued"}, job_timeout=60)
    fetched = Job(job.id, connection=conn, serializer=JSONSerializer)
    wait_for(lambda: fetched.get_status(refresh=True) == JobStatus.FAILED, 60, "failed", on_fail=proc.log_tail)
    meta = wait_for(lambda: (m := fetched.get_meta(refresh=True)).get("state") == "failed" and m, 10, "state")
    assert meta["error"]["reason"] == "invalid_request"


def test_relay_rides_out_a_redis_restart(redis_server_factory: Any) -> None:
    """A Redis restart under a running job used to fail it as `internal` (one XADD hit the closed
    connection). The relay now retries its writes through the outage; the events arrive, none lost."""
    import threading
    import time

    from worker.keys import JobState
    from worker.relay import EventRelay

    server = redis_server_factory(appendonly=True)
    conn = server.client()
    job = Queue("q", connection=conn, serializer=JSONSerializer).enqueue(RENDER_FUNC, VALID)
    relay = EventRelay(conn, job, maxlen=100, running_ttl=600)
    relay.state(JobState.STARTED)

    def restart() -> None:
        server.kill()
        time.sleep(1.0)
        server.start()

    t = threading.Thread(target=restart)
    t.start()
    time.sleep(0.2)  # Redis is down now
    for step in range(1, 4):
        relay.emit({"type": "progress", "stage": "denoise", "step": step, "total": 3})
    relay.state(JobState.FAILED, error={"reason": "x"}, ttl=60)
    t.join()
    kinds = [f[b"type"] for _, f in conn.xrange(f"ltx:job:{job.id}:events")]
    assert kinds.count(b"progress") >= 3 and kinds[0] == b"state" and kinds[-1] == b"state"
    assert 0 < conn.ttl(f"ltx:job:{job.id}:events") <= 60
    assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).get_meta()["state"] == "failed"
    conn.close()


def test_job_dequeued_by_a_worker_that_died_before_starting_it_is_requeued(one_worker: Any) -> None:
    """A worker SIGKILLed between dequeuing a job and starting it leaves the job in RQ's intermediate
    queue; RQ's cleanup used to fail it (no retry, meta stuck at `retrying`/`queued`, no terminal event).
    Now it counts as `worker_lost`: re-queued within that budget, and the job renders."""
    from rq.intermediate_queue import IntermediateQueue
    from rq.utils import now

    proc, conn, queue, _, _ = one_worker
    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    job = q.create_job(RENDER_FUNC, args=(dict(VALID, prompt="t"),), meta={"state": "queued"}, timeout=60)
    job.save()
    # what a dequeue leaves behind when its worker dies before starting the job: the id sits in the
    # intermediate queue only (not in the queue, not in the started registry)
    intermediate = IntermediateQueue(q.key, connection=conn)
    conn.set(intermediate.get_first_seen_key(job.id), now().timestamp() - 120)
    conn.rpush(intermediate.key, job.id)
    assert wait_state(job, {"uploaded", "failed"}, 60, proc) == "uploaded", job.get_meta(refresh=True)
    meta = job.get_meta(refresh=True)
    assert meta["retries"] == {"worker_lost": 1}
