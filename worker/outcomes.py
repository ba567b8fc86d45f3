"""How a render job's attempt ends, decided and recorded in one place, whichever path ends it.

Paths that end an attempt: the job function (the service: invalid request, runner error, fleet failure,
no output, cold stop, RQ's death penalty, cancel), the background uploader (upload failed after the job
returned), RQ's abandoned-job cleanup run by any worker (the worker running it vanished), RQ's
intermediate-queue cleanup (the worker vanished between dequeue and start), and the worker's exception
handler (a job that failed before the service saw it). Each calls `JobOutcomes`, which

- decides retry or not: re-queue while the reason's budget (`WorkerSettings.retry_<reason>`) is not spent
  and the failure is retryable; the budget counts per reason in meta `retries`, so only real losses of
  that kind spend it, and it is read from the settings by whoever records the end (a budget the dead
  execution never got to write cannot be missing);
- records it: a `retrying` or terminal state event with the error, meta `attempts` (one entry per attempt
  that did not succeed: which attempt, which worker, how it ended), the stream's TTL;
- tells RQ through `rqcompat.set_retry` (RQ's own failure handling and cleanup then re-queue or fail it);
- counts it in the metrics.

TTLs (result, failure, the running stream's) are computed here too, and `uploaded`/`cancelled` are
recorded here. RQ's registries are touched only by `worker.rqcompat`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import rqcompat
from .keys import FailureReason, JobState
from .relay import EventRelay
from .settings import WorkerSettings

__all__ = ["JobOutcomes", "attempt_count"]

log = logging.getLogger("worker.outcomes")

_MESSAGE_IN_HISTORY = 300  # characters of each failed attempt's message kept in meta `attempts`
_HISTORY_LEN = 20  # attempts kept (budgets are small; this only bounds a hostile or buggy loop)


class JobOutcomes:
    """Retry budgets, TTLs and end-of-attempt records for the jobs of one worker process."""

    def __init__(self, settings: WorkerSettings, *, worker_name: str, metrics: Any = None) -> None:
        self.settings = settings
        self.worker_name = worker_name
        self.metrics = metrics  # WorkerMetrics (None in tools that only record)

    # ==== policy ======================================================================================
    def budget(self, reason: FailureReason) -> int:
        """How often a job may be re-queued for `reason` (0: never)."""
        s = self.settings
        return {
            FailureReason.FLEET_FAILURE: s.retry_fleet_failure,
            FailureReason.WORKER_LOST: s.retry_worker_lost,
            FailureReason.WORKER_SHUTDOWN: s.retry_worker_shutdown,
            FailureReason.UPLOAD_FAILED: s.retry_upload_failed,
            FailureReason.JOB_TIMEOUT: s.retry_job_timeout,
            FailureReason.SPOOL_ERROR: s.retry_spool_error,
        }.get(reason, 0)

    def attempts_left(self, job: Any) -> int:
        """Executions the hard cap (`max_attempts`) still allows after the current one (meta `attempt`)."""
        return max(0, self.settings.max_attempts - attempt_count(_meta(job)))

    def result_ttl(self, job: Any) -> int:
        ttl = job.result_ttl if job.result_ttl is not None else self.settings.result_ttl
        return int(ttl) if ttl and ttl > 0 else self.settings.failure_ttl

    def failure_ttl(self, job: Any) -> int:
        return int(job.failure_ttl or self.settings.failure_ttl)

    def running_ttl(self, job: Any) -> int:
        """The event stream's expiry while the job is not finished: outlives the longest run, then the
        longest of the TTLs a terminal state will set."""
        longest_run = max(int(job.timeout or 0), int(self.settings.render_timeout))
        return longest_run + max(self.result_ttl(job), self.failure_ttl(job)) + 3600

    def relay(self, job: Any) -> EventRelay:
        meta = _meta(job)
        job.meta = meta
        return EventRelay(job.connection, job, maxlen=self.settings.events_maxlen, running_ttl=self.running_ttl(job))

    # ==== attempts that did not succeed =================================================================
    def failed(
        self,
        job: Any,
        reason: FailureReason,
        message: str,
        *,
        relay: EventRelay | None = None,
        retryable: bool | None = None,
        **details: Any,
    ) -> bool:
        """Record a failed attempt: `retrying` while the reason's budget lasts (unless `retryable` is False),
        else a terminal `failed` whose error lists every attempt. Sets RQ's retry decision on `job`.
        Returns True when the job will be re-queued. Whatever the reason's budget, no job is re-queued once
        it has had `max_attempts` executions (the hard cap: a loop of any kind ends in a recorded failure)."""
        relay = relay or self.relay(job)
        meta = relay.meta
        retries: dict[str, int] = dict(meta.get("retries") or {})
        budget = self.budget(reason)
        used = int(retries.get(reason.value, 0))
        capped = self.attempts_left(job) <= 0
        retry = used < budget and retryable is not False and not capped
        if capped and used < budget and retryable is not False:
            details = {**details, "attempts_cap": self.settings.max_attempts}
        if retryable is None:
            retryable = budget > 0
        attempts = _history(meta, self._attempt_entry(job, meta, "retrying" if retry else "failed", reason,
                                                            message, details))  # fmt: skip
        error = {"reason": reason.value, "message": message, "retryable": bool(retryable), **details,
                 "attempts": attempts}  # fmt: skip
        rqcompat.set_retry(job, retry)
        if retry:
            retries[reason.value] = used + 1
            relay.update_summary(retries=retries, attempts=attempts)
            relay.state(JobState.RETRYING, error=error, retry=used + 1, of=budget)
            self._count("retrying", reason)
            log.warning("job %s: %s; re-queued (retry %d of %d)", job.id, message, used + 1, budget)
        else:
            relay.update_summary(attempts=attempts)
            relay.state(JobState.FAILED, error=error, ttl=self.failure_ttl(job))
            self._count("failed", reason)
            log.error("job %s failed: %s (%s)", job.id, message, _attempts_text(attempts))
        return retry

    def lost_unrecorded(self, job: Any, relay: EventRelay) -> None:
        """A new execution found the job in a running state: the previous one vanished and nobody recorded
        it (e.g. the cleanup's write failed). It is a real loss: count it against `worker_lost`."""
        meta = relay.meta
        retries: dict[str, int] = dict(meta.get("retries") or {})
        key = FailureReason.WORKER_LOST.value
        retries[key] = int(retries.get(key, 0)) + 1
        entry = self._attempt_entry(job, meta, "lost", FailureReason.WORKER_LOST,
                                    "the previous execution vanished unrecorded", {})  # fmt: skip
        relay.update_summary(retries=retries, attempts=_history(meta, entry))

    # ==== the other ends =================================================================================
    def cancelled(self, job: Any, relay: EventRelay | None = None, **extra: Any) -> None:
        """Record a cancel (terminal; never retried)."""
        rqcompat.set_retry(job, False)
        (relay or self.relay(job)).state(JobState.CANCELLED, ttl=self.failure_ttl(job), **extra)
        self._count("cancelled", None)

    def uploaded(self, job: Any, relay: EventRelay, result: dict[str, Any]) -> None:
        """Record success: the result, the stream's result TTL; the current error is cleared (the attempt
        history stays in meta `attempts`)."""
        relay.state(JobState.UPLOADED, result=result, ttl=self.result_ttl(job))
        self._count("uploaded", None)

    # ==== helpers ======================================================================================
    def _attempt_entry(self, job: Any, meta: dict[str, Any], outcome: str, reason: FailureReason, message: str,
                       details: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        worker = details.get("worker") or meta.get("worker") or getattr(job, "worker_name", None) or None
        entry = {"attempt": meta.get("attempt"), "worker": worker, "outcome": outcome, "reason": reason.value,
                 "message": message[:_MESSAGE_IN_HISTORY], "at": round(time.time(), 3)}  # fmt: skip
        if details.get("fleet_reason"):
            entry["fleet_reason"] = details["fleet_reason"]
        return entry

    def _count(self, outcome: str, reason: FailureReason | None) -> None:
        if self.metrics is not None:
            self.metrics.job_outcome(outcome, reason.value if reason else "")


def attempt_count(meta: dict[str, Any]) -> int:
    """Meta `attempt` (executions so far) as an int; a value that is not one (a hand-written hash) counts
    as the cap's worth rather than none, so junk can never reset the cap."""
    value = meta.get("attempt")
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return 1 << 30


def _meta(job: Any) -> dict[str, Any]:
    return job.meta if isinstance(job.meta, dict) else {}


def _history(meta: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    previous = meta.get("attempts")
    history = [a for a in previous if isinstance(a, dict)] if isinstance(previous, list) else []
    return [*history, entry][-_HISTORY_LEN:]


def _attempts_text(attempts: list[dict[str, Any]]) -> str:
    """One line for logs and final errors: "attempt 1 fleet_failure on w1; attempt 2 worker_lost on w2"."""
    return "; ".join(f"attempt {a.get('attempt')} {a.get('reason')} on {a.get('worker')}" for a in attempts)
