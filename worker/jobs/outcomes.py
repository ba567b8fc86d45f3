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
- tells RQ through `JobRecord.set_retry` (RQ's own failure handling and cleanup then re-queue or fail it);
- counts it in the metrics.

The limits the worker owns are applied here (`own_limits`): RQ's `job_timeout` comes from the settings and
the result/failure TTLs are capped by them, whatever the enqueuer wrote. TTLs (result, failure, the
running stream's) are computed here too, and `uploaded`/`cancelled` are
recorded here. RQ's registries are touched only by the RQ wing (`worker.rq`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from ltx_contract.states import FailureReason, JobState
from worker.ops.error_ids import public_message
from worker.protocol.relay import EventRelay
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings

__all__ = ["RQ_TIMEOUT_MARGIN_S", "JobOutcomes", "attempt_count"]

log = logging.getLogger("worker.jobs.outcomes")

_MESSAGE_IN_HISTORY = 300  # characters of each failed attempt's message kept in meta `attempts`
RQ_TIMEOUT_MARGIN_S = 30  #: RQ's death penalty fires this long after the fleet's own render timeout
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
            # Once: the ranks freed what the job held, so a retry may fit (another job's memory, fragmentation);
            # a second out-of-memory error says the request does not fit this fleet.
            FailureReason.OUT_OF_MEMORY: 1,
        }.get(reason, 0)

    def attempts_left(self, job: JobRecord) -> int:
        """Executions the hard cap (`max_attempts`) still allows after the current one (meta `attempt`)."""
        return max(0, self.settings.max_attempts - attempt_count(_meta(job)))

    # ==== limits the worker owns (never the enqueuer's) ======================================
    def rq_timeout(self) -> int:
        """RQ's death penalty for one execution (its `job_timeout`): the render timeout plus a margin, so
        the fleet's own timeout, which is recoverable, always fires first; with synchronous uploads the job
        function uploads too, so it gets as long again. An enqueuer's `job_timeout` is ignored: a small one
        raised RQ's JobTimeoutException mid-render and rebuilt the fleet."""
        render = math.ceil(self.settings.render_timeout) + RQ_TIMEOUT_MARGIN_S
        return render if self.settings.upload_pipeline else 2 * render

    def kept_result_ttl(self, job: JobRecord) -> int:
        """The job's `result_ttl` in RQ's meaning (-1: forever, 0: not kept), capped by the settings'."""
        cap, ttl = self.settings.result_ttl, job.result_ttl
        if ttl is None or (cap >= 0 and (ttl < 0 or ttl > cap)):
            return cap
        return int(ttl)

    def result_ttl(self, job: JobRecord) -> int:
        """Seconds a successful job's records (stream, result) live: the kept result TTL, or the failure
        TTL when the result is kept forever or not at all (its events still need an expiry)."""
        ttl = self.kept_result_ttl(job)
        return ttl if ttl > 0 else self.settings.failure_ttl

    def failure_ttl(self, job: JobRecord) -> int:
        """The job's `failure_ttl` capped by the settings' (a client asked for 10^9 s)."""
        cap, ttl = self.settings.failure_ttl, job.failure_ttl
        return min(int(ttl), cap) if ttl and ttl > 0 else cap

    def own_limits(self, job: JobRecord) -> None:
        """Before an execution: RQ's timeout from the settings and the TTLs capped, on the job object (RQ's
        death penalty and its success/failure handling read them there) and in the hash (the cleanups and
        tools of other processes read them there)."""
        job.own_limits(
            timeout=self.rq_timeout(), result_ttl=self.kept_result_ttl(job), failure_ttl=self.failure_ttl(job)
        )

    def running_ttl(self, job: JobRecord) -> int:
        """The event stream's expiry while the job is not finished: outlives the longest run, then the
        longest of the TTLs a terminal state will set."""
        return self.rq_timeout() + max(self.result_ttl(job), self.failure_ttl(job)) + 3600

    def relay(self, job: JobRecord) -> EventRelay:
        meta = _meta(job)
        job.meta = meta
        return EventRelay(job.connection, job, maxlen=self.settings.events_maxlen, running_ttl=self.running_ttl(job))

    # ==== attempts that did not succeed =================================================================
    def failed(
        self,
        job: JobRecord,
        reason: FailureReason,
        message: str,
        *,
        relay: EventRelay | None = None,
        retryable: bool | None = None,
        quiet: bool = False,
        **details: Any,
    ) -> bool:
        """Record a failed attempt: `retrying` while the reason's budget lasts (unless `retryable` is False),
        else a terminal `failed` whose error lists every attempt. Sets RQ's retry decision on `job`.
        Returns True when the job will be re-queued. Whatever the reason's budget, no job is re-queued once
        it has had `max_attempts` executions (the hard cap: a loop of any kind ends in a recorded failure).
        `quiet`: log at DEBUG (the caller logs one line for many, e.g. a flood refused by admission)."""
        relay = relay or self.relay(job)
        message, error_id = public_message(message, context=f"job {job.id}")  # (no traceback reaches Redis)
        if error_id is not None:
            details = {**details, "error_id": error_id}
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
        job.set_retry(retry)
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
            log.log(logging.DEBUG if quiet else logging.ERROR, "job %s failed: %s (%s)", job.id, message,
                    _attempts_text(attempts))  # fmt: skip
        return retry

    def lost_unrecorded(self, job: JobRecord, relay: EventRelay) -> None:
        """A new execution found the job in a running state: the previous one vanished and nobody recorded
        it (e.g. the cleanup's write failed). It is a real loss: count it against `worker_lost`."""
        meta = relay.meta
        retries: dict[str, int] = dict(meta.get("retries") or {})
        key = FailureReason.WORKER_LOST.value
        retries[key] = int(retries.get(key, 0)) + 1
        entry = self._attempt_entry(job, meta, "lost", FailureReason.WORKER_LOST,
                                    "the previous execution vanished unrecorded", {})  # fmt: skip
        relay.update_summary(retries=retries, attempts=_history(meta, entry))

    def deferred(self, job: JobRecord, message: str, *, relay: EventRelay) -> bool:
        """Re-queue a job that waits for room (`JobAttempt.wait_for_room`) if its wait is not over: `retrying`
        with `error.deferred`, no retry budget spent, and this execution not counted against `max_attempts`
        (meta `attempt` back to the one before). The wait is bounded in time instead (`lora_cache_wait_s`
        from meta `waiting_since`, its first). Returns False, recording nothing, once the wait is over."""
        meta, now = relay.meta, time.time()
        since = meta.get("waiting_since")
        since = float(since) if isinstance(since, int | float) and not isinstance(since, bool) else now
        waited = max(0.0, now - since)
        if waited > self.settings.lora_cache_wait_s:
            return False
        entry = self._attempt_entry(job, meta, "deferred", FailureReason.SPOOL_ERROR, message, {})
        attempts = _history(meta, entry)
        error = {
            "reason": FailureReason.SPOOL_ERROR.value,
            "message": message,
            "retryable": True,
            "deferred": True,
            "waited_s": round(waited, 3),
            "attempts": attempts,
        }
        job.set_retry(True)
        relay.update_summary(attempt=max(0, attempt_count(meta) - 1), attempts=attempts, waiting_since=since)
        relay.state(JobState.RETRYING, error=error)
        self._count("deferred", FailureReason.SPOOL_ERROR)
        log.info(
            "job %s: %s; re-queued to wait for room (%.0f s of %.0f)",
            job.id,
            message,
            waited,
            self.settings.lora_cache_wait_s,
        )
        return True

    # ==== the other ends =================================================================================
    def cancelled(self, job: JobRecord, relay: EventRelay | None = None, **extra: Any) -> None:
        """Record a cancel (terminal; never retried)."""
        job.set_retry(False)
        (relay or self.relay(job)).state(JobState.CANCELLED, ttl=self.failure_ttl(job), **extra)
        self._count("cancelled", None)

    def uploaded(self, job: JobRecord, relay: EventRelay, result: dict[str, Any]) -> None:
        """Record success: the result, the stream's result TTL; the current error is cleared (the attempt
        history stays in meta `attempts`)."""
        relay.state(JobState.UPLOADED, result=result, ttl=self.result_ttl(job))
        self._count("uploaded", None)

    # ==== helpers ======================================================================================
    def _attempt_entry(self, job: JobRecord, meta: dict[str, Any], outcome: str, reason: FailureReason, message: str,
                       details: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        worker = details.get("worker") or meta.get("worker") or job.worker_name or None
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


def _meta(job: JobRecord) -> dict[str, Any]:
    return job.meta if isinstance(job.meta, dict) else {}


def _history(meta: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    previous = meta.get("attempts")
    history = [a for a in previous if isinstance(a, dict)] if isinstance(previous, list) else []
    return [*history, entry][-_HISTORY_LEN:]


def _attempts_text(attempts: list[dict[str, Any]]) -> str:
    """One line for logs and final errors: "attempt 1 fleet_failure on w1; attempt 2 worker_lost on w2"."""
    return "; ".join(f"attempt {a.get('attempt')} {a.get('reason')} on {a.get('worker')}" for a in attempts)
