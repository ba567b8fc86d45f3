"""Abandoned jobs: RQ's registry cleanup (run by any worker) with the worker's handler, against a real Redis.
What a dead worker's job becomes, and what a cleanup racing a spool recovery must never leave behind."""

from __future__ import annotations

import json
import time

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from ltx_contract.keys import EVENT_FIELD_DATA, events_key


@pytest.mark.parametrize("lost_before", [0, 1])
def test_abandoned_job_is_recorded_as_worker_lost_with_the_budget_from_the_settings(
    redis_client, unique_name, lost_before
):
    """The dead execution may never have written a retry budget into the job (found by the chaos soak: a job taken by a
    worker that was SIGKILLed before it started the job ended `failed` although nothing was aimed at it):
    the cleaning worker decides from its settings and the losses counted so far."""
    from rq.executions import Execution
    from rq.registry import StartedJobRegistry

    from worker.jobs.outcomes import JobOutcomes
    from worker.runtime.fleet_worker import FleetWorker
    from worker.settings import WorkerSettings

    q = Queue(unique_name, connection=redis_client, serializer=JSONSerializer)
    meta = {"state": "rendering", "worker": "gone.cpu1.1", "attempt": 1 + lost_before}
    if lost_before:
        meta["retries"] = {"worker_lost": 1}
    job = q.enqueue("worker.job.render", {"prompt": "x"}, meta=meta)
    q.remove(job.id)  # it was dequeued by the worker that then vanished
    job.retries_left = 0  # nobody wrote a budget into the hash
    job.save()
    with redis_client.pipeline() as pipe:
        Execution.create(job, 5, pipeline=pipe, worker_name="gone.cpu1.1")
        pipe.execute()
    worker = FleetWorker.__new__(FleetWorker)  # only the handler's state: connection, settings, outcomes
    settings = WorkerSettings(retry_worker_lost=1)
    worker.connection, worker.settings = redis_client, settings
    worker.outcomes = JobOutcomes(settings, worker_name="cleaner.cpu1.2")
    registry = StartedJobRegistry(unique_name, connection=redis_client, serializer=JSONSerializer)
    registry.cleanup(timestamp=time.time() + 60, exception_handlers=[worker._abandoned_job_handler])
    meta = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).get_meta()
    retrying = not lost_before
    state = "retrying" if retrying else "failed"
    assert meta["state"] == state and meta["error"]["reason"] == "worker_lost", meta
    assert meta["error"]["worker"] == "gone.cpu1.1" and meta["error"]["retryable"] is True
    _, fields = redis_client.xrevrange(events_key(job.id), count=1)[0]
    assert json.loads(fields[EVENT_FIELD_DATA.encode()])["state"] == state
    assert (job.id in q.get_job_ids()) is retrying  # re-queued only while the budget lasts
    assert meta["retries"] == {"worker_lost": 1}
    # the attempt history names the attempt and the worker that vanished
    assert meta["attempts"][-1]["worker"] == "gone.cpu1.1" and meta["attempts"][-1]["reason"] == "worker_lost"
    if not retrying:
        assert meta["error"]["attempts"] == meta["attempts"]


@pytest.mark.parametrize("cleanup_checks_last", [True, False])
def test_an_uploaded_job_the_abandoned_job_cleanup_marked_failed_ends_finished(
    redis_client, unique_name, cleanup_checks_last
):
    """Chaos CI (2 loaded cores): a job ended `uploaded` with RQ status `failed`. Its worker was SIGKILLed
    after `rendered`, before RQ's bookkeeping; the restart's spool recovery finished the job while another
    worker's cleanup, which had fetched it still `uploading`, wrote `failed` in a pipeline that landed after.
    Both sides now check after their own write; either order of the two checks repairs it."""
    from rq.executions import Execution
    from rq.job import JobStatus
    from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

    from worker.jobs.outcomes import JobOutcomes
    from worker.rq.record import JobRecord
    from worker.runtime.fleet_worker import FleetWorker
    from worker.settings import WorkerSettings

    q = Queue(unique_name, connection=redis_client, serializer=JSONSerializer)
    job = q.enqueue("worker.job.render", {"prompt": "x"}, meta={"state": "uploading", "worker": "gone.cpu1.1"})
    q.remove(job.id)
    job.set_status(JobStatus.STARTED)
    with redis_client.pipeline() as pipe:
        Execution.create(job, 5, pipeline=pipe, worker_name="gone.cpu1.1")
        pipe.execute()
    worker = FleetWorker.__new__(FleetWorker)
    settings = WorkerSettings()
    worker.connection, worker.settings, worker._complete_abandoned = redis_client, settings, []
    worker.outcomes = JobOutcomes(settings, worker_name="cleaner.cpu1.2")
    recovered = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
    result = {"state": "uploaded", "bucket": "b", "key": "k"}

    def record_uploaded() -> None:  # what the recovering uploader writes: RQ's result, then `uploaded`
        recovered.meta["state"] = "uploaded"
        recovered.save_meta()

    def handler_then_recovery(job_, *exc) -> bool:  # the recovery runs while RQ's cleanup pipeline is open
        fallthrough = worker._abandoned_job_handler(job_, *exc)
        JobRecord(recovered).record_success_after_return(result, 60, "restarted.cpu1.3", recovered=True)
        if cleanup_checks_last:
            record_uploaded()
        return fallthrough

    StartedJobRegistry(unique_name, connection=redis_client, serializer=JSONSerializer).cleanup(
        timestamp=time.time() + 60, exception_handlers=[handler_then_recovery]
    )
    assert recovered.get_status(refresh=True) == JobStatus.FAILED  # the race as CI saw it
    worker._finish_complete_abandoned()  # the cleanup's check after its pipeline
    if not cleanup_checks_last:  # the uploader records `uploaded` after that check, and checks itself
        assert recovered.get_status(refresh=True) == JobStatus.FAILED
        record_uploaded()
        JobRecord(recovered).finish_if_uploaded(60, uploaded_state="uploaded")
    assert recovered.get_status(refresh=True) == JobStatus.FINISHED
    assert job.id not in FailedJobRegistry(unique_name, connection=redis_client, serializer=JSONSerializer)
    assert job.id in FinishedJobRegistry(unique_name, connection=redis_client, serializer=JSONSerializer)
    types = [r.type.name for r in recovered.results()]
    assert "FAILED" not in types and types.count("SUCCESSFUL") == 1, types
    assert not JobRecord(recovered).finish_if_uploaded(60, uploaded_state="uploaded")  # nothing left to repair
