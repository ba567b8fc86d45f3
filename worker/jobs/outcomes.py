"""The policy every end of an attempt is decided by, whichever path ends it: retry budgets, the limits the worker
owns, TTLs, and the outcome metrics. No job is passed here: the attempt (`worker.jobs.attempt.JobAttempt`)
decides and records its own end with these rules, and the paths that end an attempt ask it (the job function,
the encode and upload stages, the RQ wing's cleanups of jobs whose worker vanished, its refusals and cancels of
jobs that never ran).

- Retries: a failure is re-queued while its reason's budget (`WorkerSettings.retry_<reason>`, `budget`) is not
  spent and it is retryable; the budget counts per reason in meta `retries`, so only real losses of that kind
  spend it, and it is read from the settings by whoever records the end (a budget the dead execution never got to
  write cannot be missing). Whatever the budget, no job runs more than `max_attempts` times (`attempt_count`).
- Limits (`limits`): RQ's `job_timeout` comes from the settings and the result/failure TTLs are capped by them,
  whatever the enqueuer wrote; the TTLs of a job's records (result, failure, the running stream's) follow.
"""

from __future__ import annotations

import math
from typing import Any

from ltx_contract.states import FailureReason
from worker.settings import WorkerSettings

__all__ = ["RQ_TIMEOUT_MARGIN_S", "JobOutcomes", "attempt_count"]

RQ_TIMEOUT_MARGIN_S = 30  #: RQ's death penalty fires this long after the fleet's own render timeout


class JobOutcomes:
    """Retry budgets, limits, TTLs and outcome metrics for the jobs of one worker process."""

    def __init__(self, settings: WorkerSettings, *, worker_name: str, metrics: Any = None) -> None:
        self.settings = settings
        self.worker_name = worker_name
        self.metrics = metrics  # WorkerMetrics (None in tools that only record)

    # ==== retries =====================================================================================
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

    def attempts_left(self, meta: dict[str, Any]) -> int:
        """Executions the hard cap (`max_attempts`) still allows after the current one (meta `attempt`)."""
        return max(0, self.settings.max_attempts - attempt_count(meta))

    def count(self, outcome: str, reason: FailureReason | None) -> None:
        """Count an attempt's end in `ltx_worker_jobs_total`."""
        if self.metrics is not None:
            self.metrics.job_outcome(outcome, reason.value if reason else "")

    def queue_waited(self, group: str, seconds: float | None) -> None:
        """Count how long a job that starts on `group`'s fleet waited in its queue (`ltx_worker_queue_wait_seconds`)."""
        if self.metrics is not None and seconds is not None:
            self.metrics.queue_wait_seconds.labels(group).observe(seconds)

    # ==== limits the worker owns (never the enqueuer's) ======================================
    def rq_timeout(self) -> int:
        """RQ's death penalty for one execution (its `job_timeout`): the render timeout plus a margin, so
        the fleet's own timeout, which is recoverable, always fires first; with synchronous uploads the job
        function uploads too, so it gets as long again. An enqueuer's `job_timeout` is ignored: a small one
        raised RQ's JobTimeoutException mid-render and rebuilt the fleet."""
        render = math.ceil(self.settings.render_timeout) + RQ_TIMEOUT_MARGIN_S
        return render if self.settings.upload_pipeline else 2 * render

    def limits(self, result_ttl: int | None, failure_ttl: int | None) -> dict[str, int]:
        """What an execution runs under (the RQ wing sets them on the job), given the TTLs its enqueuer asked for: RQ's
        timeout from the settings, the TTLs capped by them (RQ's death penalty and its success and failure
        handling read them on the job; the cleanups and tools of other processes in its hash)."""
        return {
            "timeout": self.rq_timeout(),
            "result_ttl": self.kept_result_ttl(result_ttl),
            "failure_ttl": self.failure_ttl(failure_ttl),
        }

    def kept_result_ttl(self, asked: int | None) -> int:
        """A job's `result_ttl` in RQ's meaning (-1: forever, 0: not kept), capped by the settings'."""
        cap = self.settings.result_ttl
        capped = asked is None or (cap >= 0 and (asked < 0 or asked > cap))
        return cap if capped else int(asked)

    def result_ttl(self, asked: int | None) -> int:
        """Seconds a successful job's records (stream, result) live: the kept result TTL, or the failure
        TTL when the result is kept forever or not at all (its events still need an expiry)."""
        ttl = self.kept_result_ttl(asked)
        return ttl if ttl > 0 else self.settings.failure_ttl

    def failure_ttl(self, asked: int | None) -> int:
        """A job's `failure_ttl` capped by the settings' (a client asked for 10^9 s)."""
        cap = self.settings.failure_ttl
        return min(int(asked), cap) if asked and asked > 0 else cap

    def running_ttl(self, result_ttl: int | None, failure_ttl: int | None) -> int:
        """The event stream's expiry while the job is not finished: outlives the longest run, then the
        longest of the TTLs a terminal state will set."""
        return self.rq_timeout() + max(self.result_ttl(result_ttl), self.failure_ttl(failure_ttl)) + 3600


def attempt_count(meta: dict[str, Any]) -> int:
    """Meta `attempt` (executions so far) as an int; a value that is not one (a hand-written hash) counts
    as the cap's worth rather than none, so junk can never reset the cap."""
    value = meta.get("attempt")
    counts = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return 0 if value is None else value if counts else 1 << 30
