"""Requests and renders that used to cost a fleet, against a real worker (`ltx-worker one --group cpu:1`,
real Redis, real S3); the attacks of docs/security.md and out-of-memory errors on CPU ranks.

- `frame_rate: 1e-300` (an OverflowError on the rank) or `1e-6` (a 115 GB allocation) killed the rank on
  every attempt: now refused as a request error naming the field, with no rebuild (the producer refuses it
  too: tests/test_producer_bounds.py);
- a render that raises an out-of-memory error, a TypeError or a RuntimeError on every rank ends the job
  (`out_of_memory`, retried once; `runner_error`, never), and the same fleet renders the next job;
- a job whose renders poisoned the fleet twice is failed without another retry, and re-pushing its id
  does not crash the fleet again (`worker.jobs.poison`); one whose rank died of its own doing (SIGSEGV) is
  not retried on the same group at all.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from ltx_contract.keys import RENDER_FUNC
from tests.support.fleet import JobFleet as Worker
from tests.support.fleet import running_worker
from tests.support.wait import wait_for
from tests.support.workers import enqueue, events, wait_rq_status, wait_state

pytestmark = pytest.mark.timeout(240)

REBUILDS = "ltx_worker_fleet_rebuilds_total"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    with running_worker(tmp_path_factory.mktemp("bounds"), redis_server, s3_server, handle=Worker,
                        retry_fleet_failure=1) as w:  # fmt: skip
        yield w


def _failed(worker: Worker, job: Any, timeout: float = 60) -> dict[str, Any]:
    assert wait_state(job, {"failed", "uploaded"}, timeout, worker.proc) == "failed", job.get_meta(refresh=True)
    wait_rq_status(job, {JobStatus.FAILED}, timeout, worker.proc)
    return job.get_meta(refresh=True)


def _renders_on_the_same_fleet(worker: Worker, rebuilds: float) -> None:
    job = worker.enqueue("after")
    assert wait_state(job, {"uploaded", "failed"}, 60, worker.proc) == "uploaded", job.get_meta(refresh=True)
    assert worker.metric(REBUILDS) == rebuilds


@pytest.mark.parametrize("frame_rate", [1e-300, 1e-6, float("nan"), 1e308 * 10])
def test_a_frame_rate_the_runner_cannot_do_is_a_request_error_and_no_rebuild(worker, frame_rate):
    worker.idle()
    rebuilds = worker.metric(REBUILDS)
    # pushed raw, past the producer (which refuses it: tests/test_producer_bounds.py)
    request = {"prompt": "a fox", "width": 128, "height": 96, "num_frames": 9, "frame_rate": frame_rate, "steps": 2}
    job = enqueue(worker.conn, worker.queue, request)
    meta = _failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and meta["error"]["field"] == "frame_rate", meta["error"]
    assert len(meta["attempts"]) == 1
    _renders_on_the_same_fleet(worker, rebuilds)


def test_a_5000_digit_integer_pushed_raw_fails_the_job_and_nothing_else(worker):
    worker.idle()
    rebuilds = worker.metric(REBUILDS)
    q = Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer)
    job = q.create_job(RENDER_FUNC, args=({"prompt": "t"},), timeout=600, result_ttl=3600, failure_ttl=3600)
    job.save()
    call = '["%s", null, [{"prompt": "t", "seed": %s}], {}]' % (RENDER_FUNC, "9" * 5000)  # noqa: UP031
    worker.conn.hset(job.key, mapping={"data": zlib.compress(call.encode()), "status": "queued"})
    q.push_job_id(job.id)
    wait_rq_status(job, {JobStatus.FAILED}, 60, worker.proc)
    assert worker.proc.proc.poll() is None
    _renders_on_the_same_fleet(worker, rebuilds)


@pytest.mark.parametrize(("error", "reason", "message"), [
    ("oom", "out_of_memory", "OutOfMemoryError: injected oom error"),
    ("type", "runner_error", "TypeError: injected type error"),
    ("runtime", "runner_error", "RuntimeError: injected runtime error"),
])  # fmt: skip
def test_an_error_raised_in_a_render_ends_the_job_not_the_fleet(worker, error, reason, message):
    worker.idle()
    rebuilds, pid = worker.metric(REBUILDS), worker.health()["fleet"]["pids"]
    job = worker.enqueue(f"t error={error}")
    meta = _failed(worker, job)
    # (an out-of-memory error on the lowest-memory plan says so after the message: it is not retried again)
    assert meta["error"]["reason"] == reason and meta["error"]["message"].startswith(message), meta["error"]
    assert "Traceback" not in meta["error"]["message"]
    # out of memory: retried once (the ranks freed the job's memory); any other error: never
    assert [a["reason"] for a in meta["attempts"]] == [reason] * (2 if error == "oom" else 1)
    _renders_on_the_same_fleet(worker, rebuilds)
    assert worker.health()["fleet"]["pids"] == pid


def test_a_job_that_poisoned_the_fleet_twice_is_not_retried_nor_rendered_when_re_pushed(worker):
    worker.idle()
    rebuilds = worker.metric(REBUILDS)
    job = worker.enqueue("t exit_rank=0 exit_step=1")
    meta = _failed(worker, job, timeout=120)
    assert meta["error"]["reason"] == "fleet_failure", meta["error"]
    assert "poisoned a fleet 2 times" in meta["error"]["message"]
    assert [a["reason"] for a in meta["attempts"]] == ["fleet_failure"] * 2
    worker.idle(timeout=120)
    rebuilds += 2
    assert worker.metric(REBUILDS) == rebuilds
    # re-pushing the id (as any tenant may) runs nothing: the worker remembers what it did
    job.set_status(JobStatus.QUEUED)
    Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer).push_job_id(job.id)
    time.sleep(0.5)
    again = Job.fetch(job.id, connection=worker.conn, serializer=JSONSerializer)
    wait_rq_status(again, {JobStatus.FAILED}, 60, worker.proc)
    time.sleep(1.0)
    meta = again.get_meta(refresh=True)
    assert meta["state"] == "failed" and meta["error"].get("poisoned") is True, meta["error"]
    assert "render" not in [e.get("state") for e in events(worker.conn, job.id)][-3:]
    _renders_on_the_same_fleet(worker, rebuilds)


def test_a_job_whose_rank_segfaults_is_not_retried_on_the_same_group(worker):
    """A rank dying of SIGSEGV during the job is the job's doing: one poisoning, no retry on this group
    (the budget, `retry_fleet_failure=1`, would have re-run it: a second rebuild), not rendered when re-pushed;
    a rank killed from outside keeps its retry (the test above, `exit_rank`)."""
    worker.idle()
    rebuilds = worker.metric(REBUILDS)
    job = worker.enqueue("t segv_rank=0 exit_step=1")
    meta = _failed(worker, job, timeout=120)
    assert meta["error"]["reason"] == "fleet_failure" and meta["error"]["exitcode"] == -11, meta["error"]
    assert "a retry would meet again (rank_exited) on group cpu:1" in meta["error"]["message"], meta["error"]
    assert [a["reason"] for a in meta["attempts"]] == ["fleet_failure"]
    worker.idle(timeout=120)
    rebuilds += 1
    assert worker.metric(REBUILDS) == rebuilds
    job.set_status(JobStatus.QUEUED)
    Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer).push_job_id(job.id)
    wait_for(lambda: job.get_meta(refresh=True)["error"].get("poisoned"), 60, "the re-push refused")
    _renders_on_the_same_fleet(worker, rebuilds)


def test_an_error_on_one_rank_while_the_other_waits_is_one_rebuild_and_never_rendered_again(tmp_path, redis_server,
                                                                                            s3_server):  # fmt: skip
    """The raising rank cannot be waited for: after the settle time the fleet is rebuilt, and the job is
    not retried (the same request would do it again) nor rendered when its id is pushed again."""
    with running_worker(tmp_path, redis_server, s3_server, handle=Worker, group="cpu:2", retry_fleet_failure=1,
                        fleet_error_settle_s=2) as worker:  # fmt: skip
        job = worker.enqueue("t error=oom error_rank=1")
        meta = _failed(worker, job, timeout=120)
        assert meta["error"]["reason"] == "fleet_failure" and meta["error"]["fleet_reason"] == "split", meta["error"]
        assert "for a cause a retry would meet again (split)" in meta["error"]["message"]
        assert len(meta["attempts"]) == 1
        worker.idle(timeout=120)
        assert worker.metric(REBUILDS) == 1
        job.set_status(JobStatus.QUEUED)
        Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer).push_job_id(job.id)
        wait_for(lambda: job.get_meta(refresh=True)["error"].get("poisoned"), 60, "the re-push refused")
        _renders_on_the_same_fleet(worker, 1)


def test_the_poisoned_record_follows_the_budget_and_a_lasting_cause_counts_at_once(redis_client):
    from worker.jobs import poison

    job_id = f"p-{time.time_ns()}"
    assert poison.refusal(redis_client, job_id, 2) is None
    for n in (1, 2):
        reasons = poison.record(redis_client, job_id, "rank_exited", ttl=60)
        assert poison.refusal(redis_client, job_id, 2, reasons) is None, n  # (the budget allows two retries)
    poison.record(redis_client, job_id, "timeout", ttl=60)
    assert "poisoned a fleet 3 times" in poison.refusal(redis_client, job_id, 2)
    assert 0 < redis_client.ttl(poison.poisoned_key(job_id)) <= 60
    other = f"{job_id}-split"
    poison.record(redis_client, other, "split", ttl=60)
    assert "a retry would meet again (split)" in poison.refusal(redis_client, other, 5)
    redis_client.set(poison.poisoned_key(f"{job_id}-junk"), "not json")  # (only workers write it)
    assert poison.refusal(redis_client, f"{job_id}-junk", 5) is not None


def test_a_lasting_poisoning_bars_its_group_and_a_second_one_every_group(redis_client):
    from worker.jobs import poison

    assert poison.lasting("rank_exited", -11, during_job=True, oom_kills_during_job=False)
    assert poison.lasting("rank_exited", -9, during_job=True, oom_kills_during_job=True)  # the OOM killer
    assert not poison.lasting("rank_exited", -9, during_job=True, oom_kills_during_job=False)  # killed from outside
    assert not poison.lasting("rank_exited", 9, during_job=True, oom_kills_during_job=False)
    assert not poison.lasting("timeout", None, during_job=True, oom_kills_during_job=True)
    assert not poison.lasting("rank_exited", -11, during_job=False, oom_kills_during_job=False)  # before the job
    job_id = f"g-{time.time_ns()}"
    entries = poison.record(redis_client, job_id, "rank_exited", ttl=60, group="cuda:0-3", lasting=True)
    assert "on group cuda:0-3" in poison.refusal(redis_client, job_id, 5, entries, group="cuda:0-3")
    assert poison.refusal(redis_client, job_id, 5, group="cuda:4-7") is None  # another group may take it once
    poison.record(redis_client, job_id, "rank_exited", ttl=60, group="cuda:4-7", lasting=True)
    assert "on two groups" in poison.refusal(redis_client, job_id, 5, group="cpu:1")
    redis_client.set(poison.poisoned_key(f"{job_id}-old"), '["rank_exited", "split"]')  # (before groups were kept)
    assert "(split)" in poison.refusal(redis_client, f"{job_id}-old", 5, group="cpu:1")
