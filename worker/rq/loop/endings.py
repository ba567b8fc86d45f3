"""How an execution ends, as RQ's hooks see it, and jobs whose worker vanished.

- Expected outcomes (a failure with a reason, a cancel) get one log line, not a traceback; a job that failed
  before the service could record it still gets a terminal `failed` state (`_record_unrecorded_failure`).
- A cancel is recorded `canceled` in RQ's canceled registry, not `stopped` in its failed registry (a cancel
  is not a failure).
- Jobs whose worker vanished (found by RQ's abandoned-job or intermediate-queue cleanup, run by any worker
  on the queue) are recorded as `worker_lost` by their `worker.jobs.attempt.JobAttempt`, with the budget from the
  settings.
  The cleanup's lock expires after `maintenance_lock_ttl` (RQ's: 15 minutes, so one worker SIGKILLed
  mid-cleanup stopped abandoned-job recovery on the whole queue for that long).
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any

import redis
from rq.exceptions import AbandonedJobError, StopRequested
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.worker import SimpleWorker

from ltx_contract.states import RECORDED_END_STATES, RENDER_COMPLETE_STATES, TERMINAL_STATES, FailureReason, JobState
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Failure, JobCancelledByClient, JobFailed
from worker.jobs.outcomes import JobOutcomes
from worker.rq.loop import registries, unstarted, worker_state
from worker.rq.loop.job_class import RefusedJob
from worker.rq.record import JobRecord, set_retry
from worker.settings import WorkerSettings

__all__ = ["EndingWorker", "maintenance_lock_ttl"]

log = logging.getLogger("worker.rq")


class EndingWorker(SimpleWorker):
    """RQ's failure, exception and registry-cleanup hooks (module docstring). `RqWorker` sets the
    attributes below in its `__init__`."""

    settings: WorkerSettings
    outcomes: JobOutcomes
    _complete_abandoned: list[Job]  #: jobs the last cleanup found complete (see `clean_registries`)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """Expected outcomes (a failure with a reason, a cancel) get one log line, not a traceback."""
        exc = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(exc, JobCancelledByClient):
            worker_state.mark_stopped(self, job.id)  # however the cancel arrived: RQ must not retry or fail it
        if not isinstance(exc, JobFailed | JobCancelledByClient | AbandonedJobError):
            self._record_unrecorded_failure(job, exc)
        if isinstance(exc, JobFailed | JobCancelledByClient):
            log.info("job %s ended: %s", job.id, exc)
            for handler in worker_state.exception_handlers(self):
                handler(job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    def handle_job_failure(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry | None = None, exc_string: str = ""
    ) -> None:
        if worker_state.stopped_job_id(self) == job.id:
            # a cancel, not a failure: `canceled` in RQ's canceled registry (its default: failed registry)
            unstarted.record_cancelled_execution(self, job, self.outcomes.failure_ttl(job.failure_ttl))
            return None
        if exc_string.startswith(registries.STUCK_IN_INTERMEDIATE):
            if registries.stale_intermediate_entry(job, queue):  # RQ drops the entry after this returns
                log.info(
                    "job %s: stale intermediate-queue entry dropped (the job is %s)",
                    job.id,
                    job.get_status(refresh=False),
                )
                return None
            self._record_lost(job, "the worker that dequeued this job vanished before starting it")
        return super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _record_unrecorded_failure(self, job: Job, exc: BaseException | None) -> None:
        """A job that failed before the service could record it (a refused function, arguments that do not
        fit `render(request)`) still gets a terminal `failed` state, so watchers never wait forever."""
        meta = job.meta if isinstance(job.meta, dict) else {}
        state = meta.get("state")
        if state in RECORDED_END_STATES:
            return  # the service recorded it and set the retry decision
        # Nobody decided: never re-queue on the `retries_left` the job hash came with (a client's or a
        # stale one), even if recording below fails (this path never spent a budget).
        set_retry(job, False)
        try:
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return
            # a TypeError before the service started the job: arguments that do not fit render(request)
            refused = isinstance(exc, RefusedJob) or (isinstance(exc, TypeError) and state in (None, "queued"))
            reason = FailureReason.INVALID_REQUEST if refused else FailureReason.INTERNAL
            failure = Failure(reason, f"{type(exc).__name__}: {exc}"[:2000], retryable=False)
            JobAttempt(JobRecord(job), self.outcomes).decide(failure)
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record the failure of job %s", getattr(job, "id", "?"), exc_info=True)

    def _record_lost(self, job: Job, message: str) -> None:
        """The worker running (or holding) `job` vanished: re-queue within the `worker_lost` budget from
        the settings (never from a value the dead execution may not have written), record it either way."""
        try:
            meta = job.meta if isinstance(job.meta, dict) else {}
            worker = meta.get("worker") or job.worker_name or None  # (RQ's field: who dequeued it)
            failure = Failure(FailureReason.WORKER_LOST, message, details={"worker": worker})
            JobAttempt(JobRecord(job), self.outcomes).decide(failure)
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record the loss of job %s", getattr(job, "id", "?"), exc_info=True)

    # ==== abandoned jobs (found by registry cleanup, possibly for another worker's job) ===============
    def clean_registries(self) -> None:
        """RQ's registry maintenance under a lock that a dead holder keeps for at most three maintenance
        intervals (RQ's keeps it 15 minutes: see `registries.clean_registries`)."""
        self._complete_abandoned = []
        try:
            registries.clean_registries(self, lock_ttl_s=maintenance_lock_ttl(self.settings.maintenance_interval))
        finally:
            self._finish_complete_abandoned()

    def _finish_complete_abandoned(self) -> None:
        """RQ wrote `failed` for each job our handler declined to re-queue (a complete render); a spool
        recovery that recorded `uploaded` meanwhile cannot see that write, so the check after it is ours."""
        for job in self._complete_abandoned:
            with contextlib.suppress(redis.RedisError):
                ttl = self.outcomes.result_ttl(job.result_ttl)
                JobRecord(job).finish_if_uploaded(ttl, uploaded_state=JobState.UPLOADED.value)
        self._complete_abandoned = []

    def _abandoned_job_handler(
        self, job: Job, exc_type: type[BaseException] | None, exc_value: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc_type is not AbandonedJobError and not isinstance(exc_value, AbandonedJobError):
            return True
        meta = job.meta if isinstance(job.meta, dict) else {}
        state = meta.get("state")
        if state in RENDER_COMPLETE_STATES or state in TERMINAL_STATES:
            # The render is complete (a worker SIGKILLed between `rendered` and RQ's own bookkeeping leaves
            # the job in the started registry; its restart recovers the video from the spool and uploads it,
            # and a re-queue here would render and upload it again: two terminal states). The committed
            # video is in the host's spool and the next worker start there recovers it and records the
            # outcome, moving RQ's status from `failed` to `finished`; an `uploaded` job is done. So: never
            # re-run it and write no event.
            # (`failed`/`cancelled`: the execution recorded its end and vanished before RQ's bookkeeping.)
            set_retry(job, False)
            self._complete_abandoned.append(job)
            log.warning(
                "abandoned job %s (worker %s) is already %s: not re-queued%s",
                job.id,
                meta.get("worker"),
                state,
                "; the spool recovery uploads/records it" if state in RENDER_COMPLETE_STATES else "",
            )
            return True
        self._record_lost(job, "the worker running this job vanished (no heartbeat)")
        return True


def maintenance_lock_ttl(maintenance_interval: int) -> int:
    """Seconds a registry-maintenance lock lives: long enough for any cleanup to finish, short enough that a
    worker killed while holding it delays abandoned-job recovery by little more than its detection."""
    return max(30, 3 * int(maintenance_interval))
