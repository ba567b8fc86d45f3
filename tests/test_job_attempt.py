"""`worker.jobs.attempt.JobAttempt`: one execution of one job, and each way it ends (a `worker.jobs.ends` value the
attempt decides: `conclude`, `ended_after_return`) recorded exactly once.

Real Redis and real RQ jobs (the records are Redis writes: state events in the job's stream, meta, RQ's
retry decision and registries), real `JobOutcomes` with settings whose budgets the assertions name. Also
`FleetRender` telling an attempt's end once when `controller.stream()` refuses the runner kwargs (it was recorded
as `invalid_request`, then again as `internal`), and the rule that no `job: Any` is left in worker/.
"""

from __future__ import annotations

import errno
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from ltx_contract.keys import EVENT_FIELD_DATA, events_key
from ltx_contract.states import FailureReason
from worker.jobs import poison
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Failure, JobCancelledByClient, JobFailed
from worker.jobs.outcomes import JobOutcomes
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def make(redis_client: Any, unique_name: str) -> Any:
    """`make(meta=..., **settings)`: a fresh RQ job (as RQ hands it to the job function) and its attempt; the
    RQ job itself is `make.jobs[attempt.id]` (what RQ's own handling of the job reads)."""
    queue = Queue(unique_name, connection=redis_client, serializer=JSONSerializer)

    def build(meta: dict[str, Any] | None = None, **settings: Any) -> JobAttempt:
        job = queue.enqueue("worker.job.render", {"prompt": "x"}, meta=meta or {})
        queue.remove(job.id)  # (dequeued: the worker runs it)
        build.jobs[job.id] = job
        return JobAttempt(JobRecord(job), JobOutcomes(WorkerSettings(**settings), worker_name="w.cpu1.1"))

    build.queue = queue
    build.jobs = {}
    return build


def states(attempt: JobAttempt) -> list[dict[str, Any]]:
    """The state events in the job's stream, oldest first."""
    entries = attempt.record.connection.xrange(events_key(attempt.id))
    events = [json.loads(fields[EVENT_FIELD_DATA.encode()]) for _, fields in entries]
    return [e for e in events if e.get("type") == "state"]


def stored_meta(attempt: JobAttempt) -> dict[str, Any]:
    return Job.fetch(attempt.id, connection=attempt.record.connection, serializer=JSONSerializer).get_meta()


def test_a_failure_concluded_records_one_terminal_state_and_raises_job_failed(make) -> None:
    attempt = make()
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(Failure(FailureReason.RUNNER_ERROR, "boom", details={"detail": 7}))
    assert raised.value.reason is FailureReason.RUNNER_ERROR and raised.value.retrying is False
    assert raised.value.details == {"detail": 7}
    (event,) = states(attempt)
    assert event["state"] == "failed" and event["error"]["reason"] == "runner_error" and event["error"]["detail"] == 7
    assert [a["reason"] for a in stored_meta(attempt)["attempts"]] == ["runner_error"]


def test_a_failure_within_the_budget_is_retrying_and_reraise_raises_the_given_exception(make) -> None:
    attempt = make(retry_job_timeout=1)
    stop = SystemExit(1)
    with pytest.raises(SystemExit) as raised:
        attempt.conclude(Failure(FailureReason.JOB_TIMEOUT, "slow", reraise=stop))
    assert raised.value is stop
    assert [e["state"] for e in states(attempt)] == ["retrying"]
    assert stored_meta(attempt)["retries"] == {"job_timeout": 1}


@pytest.mark.parametrize(("code", "retryable"), [(errno.ENOSPC, True), (errno.ENAMETOOLONG, False)])
def test_a_spool_failure_names_the_errno_and_retries_only_what_another_host_may_fix(make, code, retryable) -> None:
    attempt = make(retry_spool_error=1)
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(Failure.spool(OSError(code, "no"), where="lora cache"))
    assert raised.value.reason is FailureReason.SPOOL_ERROR and raised.value.retrying is retryable
    assert raised.value.details["errno"] == errno.errorcode[code]
    assert raised.value.message.startswith("lora cache: no")


def test_a_wait_for_room_is_retrying_without_a_budget_or_an_execution_until_its_time_is_up(make) -> None:
    """A LoRA job the cache has no room for now is re-queued (RQ retries it) with
    `error.deferred`, its `spool_error` budget and its execution (meta `attempt`) untouched; once
    `lora_cache_wait_s` from its first wait has passed it fails like a spool failure, within that budget."""
    from worker.render.lora_cache import LoraCacheFull

    full = LoraCacheFull("LoRA cache full: 5 bytes do not fit")
    attempt = make(retry_spool_error=0, lora_cache_wait_s=60)
    attempt.start(worker="w.cpu1.1", fleet="cpu:1")
    for _ in range(3):
        with pytest.raises(JobFailed) as raised:
            attempt.conclude(Failure.no_room(full))
        assert raised.value.retrying and raised.value.details == {"deferred": True}
        assert make.jobs[attempt.id].retries_left == 1  # (RQ re-queues it)
        attempt = JobAttempt(attempt.record, attempt.outcomes)  # the next execution, as the worker makes it
        attempt.start(worker="w.cpu1.1", fleet="cpu:1")
    meta = stored_meta(attempt)
    assert meta["attempt"] == 1 and not meta.get("retries"), meta  # nothing spent: not a failure
    assert [a["outcome"] for a in meta["attempts"]] == ["deferred"] * 3
    assert [e["state"] for e in states(attempt)].count("retrying") == 3
    attempt.relay.update_summary(waiting_since=meta["waiting_since"] - 61)  # (its first wait, 61 s ago)
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(Failure.no_room(full))
    assert raised.value.reason is FailureReason.SPOOL_ERROR and not raised.value.retrying  # (budget 0)
    assert states(attempt)[-1]["state"] == "failed" and raised.value.details["errno"] == "ENOSPC"


def test_a_cancel_before_the_stream_stops_it_when_watched_and_is_recorded_once(make) -> None:
    attempt = make()
    assert attempt.check_cancelled() is None  # nothing asked: no end, no record
    assert states(attempt) == []
    stream = SimpleNamespace(cancelled=0)
    stream.cancel = lambda: setattr(stream, "cancelled", stream.cancelled + 1)
    attempt.request_cancel()  # (before the render began: nothing to stop yet)
    attempt.watch(stream)
    assert stream.cancelled == 1
    attempt.request_cancel()  # (while it runs: stopped again, from this thread or any)
    assert stream.cancelled == 2
    attempt.unwatch()
    attempt.request_cancel()
    assert stream.cancelled == 2
    with pytest.raises(JobCancelledByClient):
        attempt.conclude(attempt.check_cancelled())
    assert [e["state"] for e in states(attempt)] == ["cancelled"]


def test_start_counts_the_execution_and_a_vanished_one_before_it(make) -> None:
    attempt = make(meta={"state": "rendering", "attempt": 1})
    assert attempt.start(worker="w.cpu1.1", fleet="cpu1") is None  # (it runs)
    (event,) = states(attempt)
    assert event["state"] == "started" and event["attempt"] == 2 and event["previous_attempt_lost"] is True
    assert attempt.number == 2 and attempt.meta["retries"] == {"worker_lost": 1}


def test_start_past_the_hard_cap_fails_for_good(make) -> None:
    attempt = make(meta={"attempt": 3}, max_attempts=3)
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(attempt.start(worker="w.cpu1.1", fleet="cpu1"))
    assert raised.value.reason is FailureReason.ATTEMPTS_EXHAUSTED and raised.value.details["attempts_cap"] == 3
    assert [e["state"] for e in states(attempt)] == ["started", "failed"]


def test_a_poisoning_job_is_refused_on_that_group(make) -> None:
    attempt = make(retry_fleet_failure=2)
    assert attempt.check_poison("cpu1") is None  # never poisoned: rendered
    assert attempt.poisoned("rank_exited", group="cpu1", lasting=False) is None  # (transient, within budget)
    refused = attempt.poisoned("split", group="cpu1", lasting=True)
    assert refused is not None and "cpu1" in refused
    assert attempt.record.connection.ttl(poison.poisoned_key(attempt.id)) > 0  # (expires with the failure TTL)
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(attempt.check_poison("cpu1"))
    assert raised.value.reason is FailureReason.FLEET_FAILURE and raised.value.details == {"poisoned": True}


def test_uploaded_records_the_result_an_execution_after_it_finds(make) -> None:
    attempt = make()
    assert attempt.recorded_result() is None
    attempt.uploaded({"key": "k", "bucket": "b"})
    assert [e["state"] for e in states(attempt)] == ["uploaded"]
    again = JobAttempt(
        JobRecord(Job.fetch(attempt.id, connection=attempt.record.connection, serializer=JSONSerializer)),
        attempt.outcomes,
    )
    assert again.recorded_result() == {"key": "k", "bucket": "b"}


def test_failed_after_return_requeues_within_the_budget_then_fails_in_rq(make) -> None:
    attempt = make(retry_upload_failed=1)
    make.jobs[attempt.id].set_status(JobStatus.FINISHED)  # (the job function returned at `rendered`)
    assert attempt.ended_after_return(Failure(FailureReason.UPLOAD_FAILED, "s3 down", retryable=True)) is True
    assert attempt.id in make.queue.get_job_ids() and make.jobs[attempt.id].get_status(refresh=True) == JobStatus.QUEUED
    again_job = make.queue.fetch_job(attempt.id)
    again = JobAttempt(JobRecord(again_job), attempt.outcomes)
    make.queue.remove(again.id)
    assert again.ended_after_return(Failure(FailureReason.UPLOAD_FAILED, "s3 down", retryable=True)) is False
    assert again_job.get_status(refresh=True) == JobStatus.FAILED
    assert [e["state"] for e in states(again)] == ["retrying", "failed"]


def test_out_of_memory_retries_and_queue_wait_come_from_the_job(make) -> None:
    assert make(meta={"retries": {"out_of_memory": 1}}).out_of_memory_retries() == 1
    assert make(meta={"retries": "junk"}).out_of_memory_retries() == 0
    job = make.jobs[make().id]
    job.started_at = job.enqueued_at  # (RQ stamps it before the job function reads the job)
    attempt = JobAttempt(JobRecord(job), JobOutcomes(WorkerSettings(), worker_name="w.cpu1.1"))
    attempt.start(worker="w", fleet="g")
    assert attempt.queue_wait_s == 0.0


# ==== one outcome per attempt in FleetRender ==================================================================


def test_runner_kwargs_refused_by_the_stream_end_the_attempt_once_as_a_request_error(make, tmp_path) -> None:
    """`controller.stream()` raising TypeError (kwargs the runner does not take) was recorded as
    `invalid_request` and then, by the catch-all around the render, again as `internal`."""
    from worker.render.fleet_render import FleetRender
    from worker.uploads.spool import Spool

    def refuse(**kwargs: Any) -> None:
        raise TypeError("__call__() got an unexpected keyword argument 'media'")

    attempt = make()
    fleet = SimpleNamespace(
        controller=SimpleNamespace(stream=refuse), world_size=1, kill_for_rebuild=lambda: pytest.fail("killed")
    )
    spool = Spool(tmp_path)
    spool.prepare(attempt.id, "video.mp4")
    run = FleetRender(attempt, fleet, encoder=None, spool=spool, metrics=None, group="cpu1")
    end = run.run({"prompt": "x", "media": "frames"}, timeout=5.0)
    with pytest.raises(JobFailed) as raised:
        attempt.conclude(end)
    assert raised.value.reason is FailureReason.INVALID_REQUEST
    ended = [(e["state"], e.get("error", {}).get("reason")) for e in states(attempt)]
    assert ended == [("rendering", None), ("failed", "invalid_request")]  # (`rendering`: the render's own start)
    assert len(stored_meta(attempt)["attempts"]) == 1
    assert not spool.job_dir(attempt.id).exists()  # (the prepared directory is not left behind)


# ==== no untyped job in the worker ===========================================================================

_UNTYPED_JOB = re.compile(r"\bjob\s*:\s*(?:\"Any\"|'Any'|Any\b)")


def untyped_jobs(text: str) -> list[int]:
    """Lines (1-based) of `text` annotating a `job` as `Any`: the worker's jobs are `rq.job.Job` in the RQ wing,
    `worker.rq.record.JobRecord` outside it, or, for one execution, a `worker.jobs.attempt.JobAttempt`."""
    return [n for n, line in enumerate(text.splitlines(), 1) if _UNTYPED_JOB.search(line)]


def test_no_untyped_job_in_the_worker() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "worker").rglob("*.py"))
             if (lines := untyped_jobs(p.read_text()))}  # fmt: skip
    assert found == {}, "type jobs as rq.job.Job or JobRecord (file: lines)"
    planted = "def f(self, job: Any) -> None:\n    x: 'Job'\n    pending: Any | None  # job: Any | None\n"
    assert untyped_jobs(planted) == [1, 3]
    assert untyped_jobs("def f(job: Job, jobs: Any, job_id: Any) -> None: ...") == []


def test_the_cancel_flag_is_shared_with_other_threads(make) -> None:
    attempt = make()
    threading.Thread(target=attempt.request_cancel).start()
    assert attempt.cancel.wait(5)
