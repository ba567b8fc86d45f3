"""`JobRecord`: one job as RQ stores it, seen from the job path (the attempt, its stages, the render service).

This is the wing's interface below the work loop: `worker.jobs`, `worker.stages` and `worker.render` hold a
`JobRecord`, never an `rq.job.Job`, and ask it only what any queue would answer: the job's id, queue, meta summary
(read and written by `ltx_contract.event_stream`, which needs `id`, `key`, `serializer` and `meta`), which
submission it is, its TTLs, how long it waited; and they tell it what RQ must do about the job: re-queue it or not
when its failure is handled (`set_retry`), and, once the job function has returned at `rendered` (RQ saw it finish
while its upload was still to come), the bookkeeping RQ does not offer: re-queue it, fail it, record the upload's
result in place of the hand-off, or repair a `failed` written by a late abandoned-job cleanup. Each of those is one
Redis transaction on RQ's own structures (status, registries, results), written against rq 2.12
(`worker.rq.RQ_MINOR`).

`fetch_record` loads a job by id (the stages' recovery after a restart), `current_record` the one RQ is running
in this process (the job function).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from rq import get_current_job
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from ltx_contract.handoff import HandOff
from ltx_contract.keys import REQUEUE_TOKEN_FIELD
from ltx_contract.redis_conn import single_try

__all__ = ["JobRecord", "current_record", "fetch_record", "set_retry", "submission_of"]

log = logging.getLogger("worker.rq")


class JobRecord:
    """One RQ job as the job path sees it (module docstring): the job as loaded, read once, and what RQ is to do
    about it. Wraps the `Job` object RQ itself holds, so a decision written here (`set_retry`) is the one RQ's own
    handling of the job reads, and `meta` is the very dict RQ saves."""

    def __init__(self, job: Job) -> None:
        self._job = job
        if not isinstance(job.meta, dict):
            job.meta = {}  # (a meta that is not an object reads as an empty one)
        self.id: str = str(job.id)
        self.connection: Any = job.connection
        self.key: str = job.key  #: the job's hash (the event writer keeps the summary in its `meta` field)
        self.serializer: Any = job.serializer
        self.meta: dict[str, Any] = job.meta  #: the summary of its events (`ltx_contract.states.SUMMARY_FIELDS`)
        self.queue: str = str(job.origin)  #: the queue it was enqueued on (RQ's `origin`)
        self.submission: str | None = submission_of(job)  #: which submission of this id the hash is
        self.worker_name: str | None = getattr(job, "worker_name", None) or None  #: who dequeued it last
        #: the TTLs on the job: the worker's (the RQ worker capped the enqueuer's before the job function ran)
        self.result_ttl: int | None = job.result_ttl
        self.failure_ttl: int | None = job.failure_ttl
        #: seconds it waited in its queue (enqueued to started; to now if not started), None where RQ did not record it
        self.queue_wait_s: float | None = None
        enqueued, started = getattr(job, "enqueued_at", None), getattr(job, "started_at", None)
        with contextlib.suppress(AttributeError, OSError, ValueError):
            end = started.timestamp() if started is not None else time.time()
            self.queue_wait_s = None if enqueued is None else max(0.0, end - enqueued.timestamp())

    def __repr__(self) -> str:
        return f"JobRecord({self.id!r})"

    def returned(self) -> bool:
        """Whether RQ recorded the job function's return (status `finished`), read from the loaded hash."""
        return self._job.get_status(refresh=False) == JobStatus.FINISHED

    # ==== what RQ does with the job =====================================================================
    def set_retry(self, retry: bool) -> None:
        """Whether RQ re-queues the job when it handles the current failure (`set_retry`)."""
        set_retry(self._job, retry)

    # ==== after the job function returned at `rendered` (RQ saw it finish) ==================================
    def requeue_after_return(self, token: str) -> None:
        """Put the job back on its queue for another attempt: one transaction (registries, expiry, status,
        the queue entry), so a crash leaves it either finished or queued.

        Idempotent per `token` (one per decision to re-queue; the caller retries with the same one): sent once
        (`single_try`: redis-py re-sends a whole MULTI after a reply lost in a Redis restart, which pushed the
        id twice, and two idle workers could each take an entry), and a retry that finds `token` in the hash
        knows the first try went through, whatever happened to the job since."""
        job = self._job
        if job.connection.hget(job.key, REQUEUE_TOKEN_FIELD) == token.encode():
            return
        queue, finished, failed = _registries(job)
        set_retry(job, False)
        with single_try(job.connection).pipeline() as pipe:
            pipe.multi()  # (explicitly: RQ's enqueue_job calls multi() on a pipeline that is not yet in one)
            _drop_handoff(job, pipe)
            finished.remove(job, pipeline=pipe)
            failed.remove(job, pipeline=pipe)
            pipe.persist(job.key)
            pipe.hset(job.key, REQUEUE_TOKEN_FIELD, token)
            queue.enqueue_job(job, pipeline=pipe)
            pipe.execute()

    def fail_after_return(self, message: str, ttl: int, worker_name: str) -> None:
        """Mark the job failed in RQ (status, failed registry, a failure result)."""
        job = self._job
        _, finished, failed = _registries(job)
        with job.connection.pipeline() as pipe:
            _drop_handoff(job, pipe)
            finished.remove(job, pipeline=pipe)
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            set_retry(job, False)
            pipe.hset(job.key, "retries_left", 0)
            failed.add(job, ttl=ttl, exc_string=message, pipeline=pipe)
            Result.create_failure(job, ttl, exc_string=message, worker_name=worker_name, pipeline=pipe)
            pipe.expire(job.key, ttl)
            pipe.execute()

    def record_success_after_return(
        self, result: dict[str, Any], ttl: int, worker_name: str, *, recovered: bool
    ) -> None:
        """Record the full result as the job's RQ result, in place of the hand-off value (so `latest_result()`,
        `return_value()` and `results()` look as if the job had returned it); a recovered job whose RQ status
        is not `finished` (failed, or waiting for a retry) is moved there."""
        job = self._job
        if not job.connection.exists(job.key):
            log.info("job %s expired before its upload ended; result not recorded in RQ", job.id)
            return
        status = job.get_status(refresh=True)
        recorded = _uploaded_result_exists(job, result)
        # Sent once (`redis_conn.single_try`): redis-py would re-send the whole MULTI after a reply lost in a Redis
        # restart and add a second result; the caller retries this call, and the check above sees the first.
        with single_try(job.connection).pipeline() as pipe:
            if not recorded:  # (a spool recovery after a crash between this and the `uploaded` state: once only)
                _drop_handoff(job, pipe)
                Result.create(
                    job, Result.Type.SUCCESSFUL, ttl, return_value=result, worker_name=worker_name, pipeline=pipe
                )
            if recovered and status != JobStatus.FINISHED:
                # (`started` too: the worker died between `rendered` and RQ's own bookkeeping, so the job is
                # still in the started registry; left there, RQ's abandoned-job cleanup would later mark the
                # uploaded job failed. We hold the spool entry's lock, so no live execution owns the job.)
                _move_to_finished(job, ttl, pipe)
            if ttl > 0:
                pipe.expire(job.key, ttl)
            pipe.execute()

    def finish_if_uploaded(self, ttl: int, *, uploaded_state: str) -> bool:
        """Move a job whose meta says `uploaded_state` back to RQ `finished` (and drop the failure result) if
        RQ's abandoned-job cleanup marked it `failed`; True if it did. A worker SIGKILLed before RQ's bookkeeping
        leaves its job in the started registry: its restart uploads the spooled render and finishes the job
        while another worker's cleanup, which read the entry just before, writes `failed`. Neither write sees
        the other, so both check after writing."""
        job = self._job
        try:
            job.refresh()
        except Exception:  # (gone or unreadable: nothing to repair)
            return False
        meta = job.meta if isinstance(job.meta, dict) else {}
        if meta.get("state") != uploaded_state or job.get_status(refresh=False) == JobStatus.FINISHED:
            return False
        with job.connection.pipeline() as pipe:
            _move_to_finished(job, ttl, pipe)
            for previous in job.results():
                if previous.type == Result.Type.FAILED and "AbandonedJobError" in str(previous.exc_string or ""):
                    pipe.xdel(Result.get_key(job.id), previous.id)
            if ttl > 0:
                pipe.expire(job.key, ttl)
            pipe.execute()
        log.warning("job %s: uploaded, but RQ's abandoned-job cleanup had marked it failed; moved to finished", job.id)
        return True


def fetch_record(connection: Any, job_id: str) -> JobRecord:
    """The job `job_id` as stored (JSON serializer). Raises RQ's `NoSuchJobError` for a job that is gone, what
    loading raises for an unreadable hash, and Redis's connection errors."""
    return JobRecord(Job.fetch(job_id, connection=connection, serializer=JSONSerializer))


def current_record() -> JobRecord | None:
    """The job RQ is running in this process (inside the job function), None outside one."""
    job = get_current_job()
    return None if job is None else JobRecord(job)


def submission_of(job: Job) -> str | None:
    """Which submission a job hash is: its RQ `created_at` (set when the job is created, kept by re-queues
    and retries; a new job with a reused id gets its own). None when the hash has none."""
    created = getattr(job, "created_at", None)
    return utcformat(created) if created is not None else None


def set_retry(job: Job, retry: bool) -> None:
    """Decide whether RQ re-queues the job when it handles this failure (its `retries_left` on the job
    object, which RQ's failure handling and abandoned-job cleanup read; at once, never scheduled)."""
    job.retries_left = 1 if retry else 0
    job.retry_intervals = None


def _registries(job: Job) -> tuple[Queue, FinishedJobRegistry, FailedJobRegistry]:
    kw = {"connection": job.connection, "serializer": job.serializer}
    return Queue(job.origin, **kw), FinishedJobRegistry(job.origin, **kw), FailedJobRegistry(job.origin, **kw)


def _move_to_finished(job: Job, ttl: int, pipe: Any) -> None:
    """Queue pipeline commands that make `job` finished in every RQ structure (status and registries)."""
    queue, finished, failed = _registries(job)
    _remove_started(job, StartedJobRegistry(job.origin, connection=job.connection), pipe)
    pipe.lrem(queue.key, 0, job.id)
    failed.remove(job, pipeline=pipe)
    finished.add(job, ttl, pipeline=pipe)
    job.set_status(JobStatus.FINISHED, pipeline=pipe)


def _remove_started(job: Job, registry: StartedJobRegistry, pipe: Any) -> None:
    """Take every execution of `job` out of RQ's started registry (entries are `<job_id>:<execution_id>`;
    read from the registry itself, since a dead worker's execution records may have expired)."""
    prefix = f"{job.id}:".encode()
    entries = [e for e in job.connection.zrange(registry.key, 0, -1) if e.startswith(prefix) or e == job.id.encode()]
    if entries:
        pipe.zrem(registry.key, *entries)


def _uploaded_result_exists(job: Job, result: dict[str, Any]) -> bool:
    """True if RQ already holds a successful `uploaded` result for the same object (one per upload)."""
    for previous in job.results():
        value = previous.return_value
        if (
            previous.type == Result.Type.SUCCESSFUL
            and isinstance(value, dict)
            and value.get("state") == "uploaded"
            and value.get("key") == result.get("key")
        ):
            return True
    return False


def _drop_handoff(job: Job, pipe: Any) -> None:
    """Delete the hand-off value RQ stored as this execution's result: it stood in while the upload ran
    and is replaced by the real outcome (one result per execution, as without the pipeline)."""
    latest = job.latest_result()
    if latest is not None and HandOff.read(latest.return_value) is not None:
        pipe.xdel(Result.get_key(job.id), latest.id)
