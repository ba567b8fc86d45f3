"""Regression tests for defects the chaos suite found, each against the real thing (Redis, SeaweedFS, a real
`ltx-worker one` process with a CPU fleet). The full chaos run (test_chaos.py) covers them too; these pin
each one down in isolation and fast."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from ltx_contract.keys import RENDER_FUNC
from tests.chaos.hostile import VALID, canary_paths, raw_job_hashes
from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, enqueue, wait_ready, wait_state, worker_env
from worker.rq.loop.job_class import RefusedJob, RenderJob

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
    connection). The relay now retries its writes through the outage; the events arrive, none lost, none twice."""
    import threading
    import time

    from ltx_contract.states import JobState
    from worker.protocol.relay import EventRelay

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
    assert kinds == [b"state", b"progress", b"progress", b"progress", b"state"]  # each once (the relay's rule)
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


# ==== a render already complete when its worker died is never rendered again ==========================


def _complete_render_of_a_dead_worker(conn: Any, queue: str, spool_dir: Path) -> Any:
    """What a worker SIGKILLed between `rendered` and RQ's own bookkeeping leaves behind: meta `rendered`,
    RQ status `started`, an execution in the started registry whose heartbeat has long expired, the
    worker_lost retry budget in `retries_left`, and a committed video in the host's spool."""
    import os
    import time

    from worker.uploads.spool import Spool

    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    job = q.create_job(RENDER_FUNC, args=(dict(VALID, prompt="t"),), timeout=60, result_ttl=600, failure_ttl=600,
                       meta={"state": "rendered", "attempt": 1, "worker": "gone", "retries": {}})  # fmt: skip
    job.retries_left = 2
    job.save()
    job.set_status(JobStatus.STARTED)
    conn.zadd(f"rq:wip:{queue}", {f"{job.id}:deadexec": time.time() - 60})
    spool = Spool(spool_dir)
    spool.prepare(job.id, "video.mp4").write_bytes(os.urandom(8192))
    spool.commit(job.id, file_name="video.mp4", key=f"videos/{job.id}/video.mp4", content_type="video/mp4",
                 queue=queue, info={}, hash_now=True)  # fmt: skip
    return job


def _assert_uploaded_once(conn: Any, job: Any) -> None:
    import json as _json

    from ltx_contract.keys import EVENT_FIELD_DATA, events_key

    events = [_json.loads(f[EVENT_FIELD_DATA.encode()]) for _, f in conn.xrange(events_key(job.id))]
    states = [e["state"] for e in events if e["type"] == "state"]
    assert states.count("uploaded") == 1 and "rendering" not in states and "retrying" not in states, states
    fetched = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    assert fetched.get_meta()["state"] == "uploaded"
    assert fetched.get_status() == JobStatus.FINISHED
    uploads = [r for r in fetched.results() if r.type.name == "SUCCESSFUL" and r.return_value["state"] == "uploaded"]
    assert len(uploads) == 1
    assert not [e for e in conn.zrange(f"rq:wip:{fetched.origin}", 0, -1) if e.decode().startswith(job.id)]
    for key in (f"rq:job:{job.id}", events_key(job.id), f"rq:results:{job.id}"):
        assert conn.ttl(key) > 0, key  # a terminal job's keys expire


def test_complete_render_of_a_killed_worker_is_uploaded_not_rendered_again(
    one_worker: Any, tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """Chaos CI found a job rendered twice with two terminal states: its worker was SIGKILLed after the
    render, the restarted worker uploaded the video from the spool, and RQ's abandoned-job cleanup re-queued
    the job (still in the started registry), which rendered and uploaded again. Both orders are pinned:
    job A is found abandoned by another worker's cleanup *before* any recovery (it must not be re-queued),
    job B is recovered and uploaded *before* a cleanup (the upload must take it out of the started
    registry, or the cleanup would mark the uploaded job failed). Each ends uploaded exactly once."""
    proc, conn, queue_a, _, _ = one_worker
    spool = tmp_path / "spool"
    job_a = _complete_render_of_a_dead_worker(conn, queue_a, spool)
    # the running worker's registry cleanup (every 2 s) finds A abandoned
    wait_for(lambda: conn.zcard(f"rq:wip:{queue_a}") == 0, 30, "cleanup of A", on_fail=proc.log_tail)
    assert Job.fetch(job_a.id, connection=conn, serializer=JSONSerializer).get_meta()["state"] == "rendered"
    assert conn.lpos(f"rq:queue:{queue_a}", job_a.id) is None, "a complete render was re-queued"

    queue_b = f"q-{uuid.uuid4().hex[:8]}"
    job_b = _complete_render_of_a_dead_worker(conn, queue_b, spool)
    name = f"r{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue_b, name=name, spool=spool)
    restarted = WorkerProcess(["one", "--group", "cpu:1"], env, tmp_path / "restarted.log").start()
    try:
        for job in (job_a, job_b):
            assert wait_state(job, {"uploaded", "failed"}, 90, restarted) == "uploaded"
        wait_ready(conn, name, 1, 120, restarted)
        time.sleep(5)  # two more cleanups of B's queue: nothing may change any more
        for job in (job_a, job_b):
            _assert_uploaded_once(conn, job)
    finally:
        assert restarted.stop() == 0, restarted.log_tail()


# ==== storage unreachable at start is not fatal; misconfigured storage is ==============================


def test_worker_starting_while_s3_is_unreachable_serves_renders(
    tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """A worker restarting during an S3 outage used to exit 2 (as if misconfigured); the supervisor gave up
    after 5 quick exits and the service was down. Now it starts with storage `degraded` (health, metrics),
    renders into the spool while uploads retry, and the job is uploaded once S3 is back."""
    from devstack.tcp_proxy import TcpProxy
    from tests.support.workers import worker_health

    proxy = TcpProxy(s3_server.s3_port).start()
    proxy.block()
    conn = redis_server.client()
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=tmp_path / "spool",
                     s3_url=proxy.url, upload_attempts=200, upload_backoff_max_s=0.5)  # fmt: skip
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp_path / "worker.log").start()
    try:
        health = wait_ready(conn, name, 1, 120, proc)[0]
        assert health["storage"]["state"] == "degraded", health
        job = enqueue(conn, queue, dict(VALID, prompt="t"))
        assert wait_state(job, {"rendered", "uploading"}, 60, proc) in {"rendered", "uploading"}
        proxy.unblock()
        assert wait_state(job, {"uploaded", "failed"}, 60, proc) == "uploaded"
        wait_for(lambda: any(h["storage"]["state"] == "ok" for h in worker_health(conn, name)), 30, "storage ok")
        assert proc.proc is not None and proc.proc.poll() is None
    finally:
        proxy.unblock()
        assert proc.stop() == 0, proc.log_tail()
        proxy.block()
        conn.close()


def test_worker_with_bad_s3_credentials_still_refuses_to_start(
    tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """Only a definite configuration error (a 4xx answer) fails the start (exit 2)."""
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"c{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=tmp_path / "spool",
                     s3_secret_access_key="wrong-secret")  # fmt: skip
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp_path / "worker.log").start()
    assert proc.proc is not None
    assert proc.proc.wait(timeout=60) == 2, proc.log_tail()
    assert "cannot start" in proc.log_tail()
