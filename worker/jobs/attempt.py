"""`JobAttempt`: one execution of one render job, and the one place its end is decided and recorded.

An attempt is the job as the queue stores it (`worker.rq.record.JobRecord`), its event relay (the job's Redis
Stream and meta summary), the policy its end is decided by (`worker.jobs.outcomes.JobOutcomes`: budgets, limits,
TTLs, metrics) and what this execution knows about itself (its number, queue wait, start time, whether a client
cancelled it, the fleet stream to stop). The service, the encode stage and the upload stage each receive the same
object, so the `(job, relay)` pair is never passed by hand.

Whatever finds how an attempt ends (the service, the drive of the fleet, a stage, the RQ wing's cleanups) returns
it as a value (`worker.jobs.ends`: a `Failure` or a `Cancelled`) and hands it to one of these; nothing else
records an end:

- `decide(end)`: whether the job is re-queued (while the reason's budget lasts and the failure is retryable;
  never past `max_attempts` executions) and its record: a `retrying` or terminal state event with the error,
  meta `retries` (per reason) and `attempts` (which attempt ended how, on which worker), the stream's TTL, RQ's
  retry decision (`JobRecord.set_retry`: RQ's own failure handling and cleanups then re-queue or fail it) and
  the metrics;
- `conclude(outcome)`: the job function's end: a result is returned as it is; an end is decided and raised as
  RQ's failure handling sees it (`JobFailed`, `JobCancelledByClient`, or the exception that ended it: RQ's death
  penalty, a cold stop); a wait for room is re-queued without spending a budget while the wait lasts;
- `ended_after_return(failure)`: an end found after the job function returned (the stages: RQ already saw it
  finish): decided, then the job moved back by hand (re-queued) or failed in RQ;
- `uploaded(result)`: success (after the return: RQ's result replaced by hand first).

Thread-safety: `request_cancel` may be called from any thread (a control message) while the job's own
thread runs the render (`watch`/`unwatch` the fleet stream, `check_cancelled`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Protocol

from ltx_contract.handoff import HandOff
from ltx_contract.redis_retry import with_redis_retry
from ltx_contract.states import RUNNING_STATES, FailureReason, JobState
from worker.jobs import poison
from worker.jobs.ends import CANCELLED, Cancelled, End, Failure, JobCancelledByClient, JobFailed
from worker.jobs.outcomes import JobOutcomes, attempt_count
from worker.ops.error_ids import public_message
from worker.protocol.relay import EventRelay
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings
from worker.uploads.spool import SpoolEntry

__all__ = ["JobAttempt"]

log = logging.getLogger("worker.jobs.outcomes")  # (the logger operators read outcome lines under)

_MESSAGE_IN_HISTORY = 300  # characters of each failed attempt's message kept in meta `attempts`
_HISTORY_LEN = 20  # attempts kept (budgets are small; this only bounds a hostile or buggy loop)


class Cancellable(Protocol):
    """What a running render offers a cancel (`ltx_mgpu.Stream`)."""

    def cancel(self) -> None: ...


class JobAttempt:
    """One execution of one job; see the module docstring."""

    def __init__(
        self,
        record: JobRecord,
        outcomes: JobOutcomes,
        *,
        relay: EventRelay | None = None,
        number: int = 1,
        t0: float | None = None,
        queue_wait_s: float | None = None,
    ) -> None:
        self.record = record
        self.id = str(record.id)
        self.outcomes = outcomes
        if relay is not None:
            self.relay = relay
        self.number = number  #: this execution's count (meta `attempt`), set by `start`
        self.t0 = time.time() if t0 is None else t0  #: wall clock when the execution began
        self.queue_wait_s = queue_wait_s
        self.cancel = threading.Event()  #: a client asked to stop this attempt
        self._stream: Cancellable | None = None
        self._lock = threading.Lock()

    @functools.cached_property
    def relay(self) -> EventRelay:
        """The writer of this job's events and meta summary (made when first needed)."""
        record = self.record
        running_ttl = self.outcomes.running_ttl(record.result_ttl, record.failure_ttl)
        return EventRelay(record.connection, record, maxlen=self.settings.events_maxlen, running_ttl=running_ttl)

    @property
    def settings(self) -> WorkerSettings:
        return self.outcomes.settings

    @property
    def meta(self) -> dict[str, Any]:
        """The job's meta summary as this execution sees and writes it (`EventRelay.meta`)."""
        return self.relay.meta

    def handed_off(self, render_s: float, entry: SpoolEntry | None = None) -> dict[str, Any]:
        """What the job function gives back while the stages still work, in place of the result
        (`ltx_contract.handoff.HandOff`): the committed render's key and size, or, `entry` None, that the video is
        still being encoded (`worker.stages.encode`)."""
        if entry is None:
            handoff = HandOff(self.id, JobState.RENDERING.value, encode="pending")
        else:
            handoff = HandOff(self.id, JobState.RENDERED.value, key=entry.key, bytes=entry.size)
        return replace(handoff, render_s=round(render_s, 4), worker=self.outcomes.worker_name).to_json()

    def recorded_result(self) -> dict[str, Any] | None:
        """The result an earlier execution recorded (meta `state` uploaded), else None."""
        result = self.meta.get("result")
        return dict(result) if self.meta.get("state") == JobState.UPLOADED.value and isinstance(result, dict) else None

    def start(self, *, worker: str, fleet: str) -> Failure | None:
        """Count this execution (an earlier one found running vanished unrecorded: a `worker_lost` loss) and
        write `started`; the attempt's end if it must not run: past the hard cap (`max_attempts`), with the
        `worker_lost` budget spent by executions that vanished, or a job whose renders poisoned fleets
        (`check_poison`). `fleet`: the group it runs on."""
        lost_before = self.meta.get("state") in RUNNING_STATES
        if lost_before:
            self._lost_unrecorded()
        self.number = attempt_count(self.meta) + 1
        self.queue_wait_s = self.record.queue_wait_s
        wait = None if self.queue_wait_s is None else round(self.queue_wait_s, 4)
        lost_flag = {"previous_attempt_lost": True} if lost_before else {}
        self.relay.state(
            JobState.STARTED, attempt=self.number, worker=worker, fleet=fleet, queue_wait_s=wait, **lost_flag
        )
        cap = self.settings.max_attempts
        lost = int((self.meta.get("retries") or {}).get(FailureReason.WORKER_LOST.value, 0))
        if self.number > cap:
            message = f"execution {self.number} exceeds the cap of {cap} (LTX_MAX_ATTEMPTS)"
            end = Failure(FailureReason.ATTEMPTS_EXHAUSTED, message, retryable=False, details={"attempts_cap": cap})
        elif lost_before and lost > self.outcomes.budget(FailureReason.WORKER_LOST):
            # (executions that vanish unrecorded spend the worker_lost budget like recorded losses)
            message = f"{lost} executions vanished; the worker_lost budget is spent"
            end = Failure(FailureReason.WORKER_LOST, message, retryable=False)
        else:
            self.outcomes.queue_waited(fleet, self.queue_wait_s)
            end = self.check_poison(fleet)  # (re-pushed by id after its renders poisoned fleets: worker.jobs.poison)
        return end

    def out_of_memory_retries(self) -> int:
        """How often earlier executions of this job ran out of memory (each moves it one memory plan down)."""
        retries = self.meta.get("retries") if isinstance(self.meta.get("retries"), dict) else {}
        return int(retries.get(FailureReason.OUT_OF_MEMORY.value) or 0)

    # ==== poison (worker.jobs.poison) =====================================================================
    def check_poison(self, group: str) -> Failure | None:
        """A job whose renders poisoned fleets is not rendered again (re-pushed by id): its end, for good."""
        refused = poison.refusal(self.record.connection, self.id, self.settings.retry_fleet_failure, group=group)
        return (
            Failure(FailureReason.FLEET_FAILURE, refused, retryable=False, details={"poisoned": True})
            if refused
            else None
        )

    def poisoned(self, fleet_reason: str | None, *, group: str, lasting: bool) -> str | None:
        """Record that this attempt's render poisoned `group`'s fleet; why the job must not run again, if so."""
        connection, budget = self.record.connection, self.settings.retry_fleet_failure
        entries = poison.record(connection, self.id, fleet_reason, self.failure_ttl(), group=group, lasting=lasting)
        return poison.refusal(connection, self.id, budget, entries, group=group)

    # ==== cancel (any thread) ===========================================================================
    def request_cancel(self) -> None:
        """Stop this attempt: its render stops now if it runs, else as soon as it begins."""
        with self._lock:
            self.cancel.set()
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def watch(self, stream: Cancellable) -> None:
        """The fleet renders this attempt on `stream`: a cancel reaches it (one requested already, at once)."""
        with self._lock:
            self._stream = stream
        if self.cancel.is_set():
            stream.cancel()

    def unwatch(self) -> None:
        with self._lock:
            self._stream = None

    def check_cancelled(self) -> Cancelled | None:
        """The attempt's end if a client asked for one."""
        return CANCELLED if self.cancel.is_set() else None

    # ==== how the attempt ends: decided and recorded here only ==============================================
    def conclude(self, outcome: dict[str, Any] | End) -> dict[str, Any]:
        """The job function's end (the module docstring): `outcome` returned if it is a result, else decided,
        recorded and raised as RQ's failure handling sees it."""
        if isinstance(outcome, Cancelled):
            self.decide(outcome)
            raise JobCancelledByClient(f"job {self.id} cancelled")
        if not isinstance(outcome, Failure):  # a result, or the hand-off: what the job function returns
            return outcome
        failure = outcome
        if failure.then is not None:  # a wait for room, re-queued while it lasts
            if self._deferred(failure.message):
                raise JobFailed(failure.reason, failure.message, retrying=True, **failure.details) from None
            failure = failure.then
        retrying = self.decide(failure)
        if failure.reraise is not None:
            raise failure.reraise
        raise JobFailed(failure.reason, failure.message, retrying=retrying, **failure.details) from None

    def ended_after_return(self, failure: Failure) -> bool:
        """Decide an end found after the job function returned (RQ saw the job finish at `rendering` or
        `rendered`), then move the job back by hand: re-queued within its budget, else failed in RQ. Returns True
        when re-queued."""
        retry = self.decide(failure)
        if retry:
            token = uuid.uuid4().hex
            with_redis_retry(lambda: self.record.requeue_after_return(token))
        else:  # (retried like the success: a lost reply can at worst leave a second failure result)
            final = f"JobFailed: {failure.reason.value}: {failure.message}"
            ttl, worker = self.failure_ttl(), self.outcomes.worker_name
            with_redis_retry(lambda: self.record.fail_after_return(final, ttl, worker))
        return retry

    def uploaded(self, result: dict[str, Any], *, after_return: bool = False, recovered: bool = False) -> None:
        """Record success: the result, the stream's result TTL; the current error is cleared (the attempt history
        stays in meta `attempts`). After the job function returned (the upload stage), RQ's result is replaced
        first, so whoever sees `uploaded` finds the final result, never the hand-off (retried through a Redis
        restart: one transaction, and a result already there is not written again), and a `failed` written
        meanwhile by a late abandoned-job cleanup is repaired after."""
        ttl = self.result_ttl()
        if after_return:
            worker = self.outcomes.worker_name
            with_redis_retry(lambda: self.record.record_success_after_return(result, ttl, worker, recovered=recovered))
        self.relay.state(JobState.UPLOADED, result=result, ttl=ttl)
        self.outcomes.count("uploaded", None)
        if after_return:
            try:
                self.record.finish_if_uploaded(ttl, uploaded_state=JobState.UPLOADED.value)
            except Exception:
                log.warning("could not write a job event", exc_info=True)

    def decide(self, end: End, *, quiet: bool = False) -> bool:
        """Decide and record how this attempt ended (the module docstring). Returns True when the job will be
        re-queued. `quiet`: log a failure at DEBUG (the caller logs one line for many, e.g. a flood refused by
        admission)."""
        if isinstance(end, Cancelled):
            self.record.set_retry(False)
            self.relay.state(JobState.CANCELLED, ttl=self.failure_ttl(), **end.details)
            self.outcomes.count("cancelled", None)
            return False
        return self._failed(end, quiet=quiet)

    # ---- the records ----------------------------------------------------------------------------------
    def _failed(self, failure: Failure, *, quiet: bool) -> bool:
        """`retrying` while the reason's budget lasts (unless not retryable), else a terminal `failed` whose
        error lists every attempt. Whatever the reason's budget, no job is re-queued once it has had
        `max_attempts` executions (the hard cap: a loop of any kind ends in a recorded failure)."""
        reason, retryable, details = failure.reason, failure.retryable, dict(failure.details)
        message, error_id = public_message(failure.message, context=f"job {self.id}")  # (no traceback in Redis)
        if error_id is not None:
            details["error_id"] = error_id
        meta = self.meta
        retries: dict[str, int] = dict(meta.get("retries") or {})
        budget = self.outcomes.budget(reason)
        used = int(retries.get(reason.value, 0))
        capped = self.outcomes.attempts_left(meta) <= 0
        retry = used < budget and retryable is not False and not capped
        if capped and used < budget and retryable is not False:
            details["attempts_cap"] = self.settings.max_attempts
        if retryable is None:
            retryable = budget > 0
        entry = self._attempt_entry("retrying" if retry else "failed", reason, message, details)
        attempts = _history(meta, entry)
        error = {"reason": reason.value, "message": message, "retryable": bool(retryable), **details}
        error["attempts"] = attempts
        self.record.set_retry(retry)
        if retry:
            retries[reason.value] = used + 1
            self.relay.update_summary(retries=retries, attempts=attempts)
            self.relay.state(JobState.RETRYING, error=error, retry=used + 1, of=budget)
            self.outcomes.count("retrying", reason)
            log.warning("job %s: %s; re-queued (retry %d of %d)", self.id, message, used + 1, budget)
        else:
            self.relay.update_summary(attempts=attempts)
            self.relay.state(JobState.FAILED, error=error, ttl=self.failure_ttl())
            self.outcomes.count("failed", reason)
            level = logging.DEBUG if quiet else logging.ERROR
            log.log(level, "job %s failed: %s (%s)", self.id, message, _attempts_text(attempts))
        return retry

    def _lost_unrecorded(self) -> None:
        """A new execution found the job in a running state: the previous one vanished and nobody recorded
        it (e.g. the cleanup's write failed). It is a real loss: count it against `worker_lost`."""
        meta = self.meta
        retries: dict[str, int] = dict(meta.get("retries") or {})
        key = FailureReason.WORKER_LOST.value
        retries[key] = int(retries.get(key, 0)) + 1
        lost = "the previous execution vanished unrecorded"
        entry = self._attempt_entry("lost", FailureReason.WORKER_LOST, lost, {})
        self.relay.update_summary(retries=retries, attempts=_history(meta, entry))

    def _deferred(self, message: str) -> bool:
        """Re-queue a job that waits for room (`Failure.no_room`) if its wait is not over: `retrying` with
        `error.deferred`, no retry budget spent, and this execution not counted against `max_attempts` (meta
        `attempt` back to the one before). The wait is bounded in time instead (`lora_cache_wait_s` from meta
        `waiting_since`, its first). Returns False, recording nothing, once the wait is over."""
        meta, now = self.meta, time.time()
        since = meta.get("waiting_since")
        since = float(since) if isinstance(since, int | float) and not isinstance(since, bool) else now
        waited = max(0.0, now - since)
        if waited > self.settings.lora_cache_wait_s:
            return False
        attempts = _history(meta, self._attempt_entry("deferred", FailureReason.SPOOL_ERROR, message, {}))
        error = {
            "reason": FailureReason.SPOOL_ERROR.value,
            "message": message,
            "retryable": True,
            "deferred": True,
            "waited_s": round(waited, 3),
            "attempts": attempts,
        }
        self.record.set_retry(True)
        self.relay.update_summary(attempt=max(0, attempt_count(meta) - 1), attempts=attempts, waiting_since=since)
        self.relay.state(JobState.RETRYING, error=error)
        self.outcomes.count("deferred", FailureReason.SPOOL_ERROR)
        wait_s = self.settings.lora_cache_wait_s
        log.info("job %s: %s; re-queued to wait for room (%.0f s of %.0f)", self.id, message, waited, wait_s)
        return True

    def _attempt_entry(
        self, outcome: str, reason: FailureReason, message: str, details: dict[str, Any]
    ) -> dict[str, Any]:
        meta = self.meta
        worker = details.get("worker") or meta.get("worker") or self.record.worker_name or None
        entry = {
            "attempt": meta.get("attempt"),
            "worker": worker,
            "outcome": outcome,
            "reason": reason.value,
            "message": message[:_MESSAGE_IN_HISTORY],
            "at": round(time.time(), 3),
        }
        if details.get("fleet_reason"):
            entry["fleet_reason"] = details["fleet_reason"]
        return entry

    # ==== TTLs (the worker's, never the enqueuer's: worker.jobs.outcomes) ===================================
    def result_ttl(self) -> int:
        return self.outcomes.result_ttl(self.record.result_ttl)

    def kept_result_ttl(self) -> int:
        return self.outcomes.kept_result_ttl(self.record.result_ttl)

    def failure_ttl(self) -> int:
        return self.outcomes.failure_ttl(self.record.failure_ttl)


def _history(meta: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    previous = meta.get("attempts")
    history = [a for a in previous if isinstance(a, dict)] if isinstance(previous, list) else []
    return [*history, entry][-_HISTORY_LEN:]


def _attempts_text(attempts: list[dict[str, Any]]) -> str:
    """One line for logs and final errors: "attempt 1 fleet_failure on w1; attempt 2 worker_lost on w2"."""
    return "; ".join(f"attempt {a.get('attempt')} {a.get('reason')} on {a.get('worker')}" for a in attempts)
