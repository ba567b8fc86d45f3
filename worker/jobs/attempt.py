"""`JobAttempt`: one execution of one render job, with everything that decides and records how it ends.

An attempt is the job as the queue stores it (`worker.rq.record.JobRecord`), its event relay (the job's Redis Stream
and meta summary), the outcome rules (`worker.jobs.outcomes.JobOutcomes`: budgets, TTLs, records) and what this
execution knows about itself (its number, queue wait, start time, whether a client cancelled it, the fleet stream to
stop). The service, the encode stage and the upload stage each receive the same object, so the `(job, relay)` pair
is never passed by hand and an attempt ends through one of its methods only:

- in the job function (the service): `fail`, `spool_failed`, `wait_for_room` and `cancelled` record the end
  and raise what RQ's failure handling sees (`JobFailed`, `JobCancelledByClient`, or the exception given to
  re-raise);
- after the job function returned (the stages: RQ already saw it finish): `failed_after_return` records
  the end and moves the job back (re-queued within its budget) or fails it in RQ by hand;
- success: `uploaded`.

Thread-safety: `request_cancel` may be called from any thread (a control message) while the job's own
thread runs the render (`watch`/`unwatch` the fleet stream, `check_cancelled`).
"""

from __future__ import annotations

import errno
import threading
import time
import uuid
from typing import Any, NoReturn, Protocol

from ltx_contract.redis_retry import with_redis_retry
from ltx_contract.states import RUNNING_STATES, FailureReason, JobState
from worker.errors import WorkerError
from worker.jobs import poison
from worker.jobs.outcomes import JobOutcomes, attempt_count
from worker.protocol.relay import EventRelay
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings

__all__ = ["JobAttempt", "JobCancelledByClient", "JobFailed"]


class JobFailed(WorkerError):
    """A job ended in failure; `reason` is a `FailureReason`, `details` the machine-readable rest."""

    def __init__(self, reason: FailureReason, message: str, *, retrying: bool = False, **details: Any) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.retrying = retrying
        self.details = details


class JobCancelledByClient(WorkerError):
    """The job was cancelled by a client; the worker turns this into RQ's `stopped` status."""


class Cancellable(Protocol):
    """What a running render offers a cancel (`ltx_mgpu.Stream`)."""

    def cancel(self) -> None: ...


class JobAttempt:
    """One execution of one job; see the module docstring."""

    def __init__(self, record: JobRecord, outcomes: JobOutcomes, *, relay: EventRelay | None = None, number: int = 1,
                 t0: float | None = None, queue_wait_s: float | None = None) -> None:  # fmt: skip
        self.record = record
        self.outcomes = outcomes
        self.relay: EventRelay = relay if relay is not None else outcomes.relay(record)
        self.number = number  #: this execution's count (meta `attempt`), set by `start`
        self.t0 = time.time() if t0 is None else t0  #: wall clock when the execution began
        self.queue_wait_s = queue_wait_s
        self.cancel = threading.Event()  #: a client asked to stop this attempt
        self._stream: Cancellable | None = None
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return str(self.record.id)

    @property
    def meta(self) -> dict[str, Any]:
        """The job's meta summary as this execution sees and writes it (`EventRelay.meta`)."""
        return self.relay.meta

    @property
    def settings(self) -> WorkerSettings:
        return self.outcomes.settings

    @property
    def submission(self) -> str | None:
        """Which submission of this job id this is (`JobRecord.submission`)."""
        return self.record.submission

    # ==== state transitions =============================================================================
    def state(self, state: JobState, **fields: Any) -> None:
        self.relay.state(state, **fields)

    def emit(self, event: dict[str, Any]) -> None:
        self.relay.emit(event)

    def recorded_result(self) -> dict[str, Any] | None:
        """The result an earlier execution recorded (meta `state` uploaded), else None."""
        result = self.meta.get("result")
        return dict(result) if self.meta.get("state") == JobState.UPLOADED.value and isinstance(result, dict) else None

    def start(self, *, worker: str, fleet: str) -> None:
        """Count this execution (an earlier one found running vanished unrecorded: a `worker_lost` loss),
        write `started`, then enforce the hard cap (`max_attempts`) and the `worker_lost` budget."""
        lost_before = self.meta.get("state") in RUNNING_STATES
        if lost_before:
            self.outcomes.lost_unrecorded(self.record, self.relay)
        self.number = attempt_count(self.meta) + 1
        self.queue_wait_s = self.record.queue_wait_s()
        wait = None if self.queue_wait_s is None else round(self.queue_wait_s, 4)
        self.state(JobState.STARTED, attempt=self.number, worker=worker, fleet=fleet, queue_wait_s=wait,
                   **({"previous_attempt_lost": True} if lost_before else {}))  # fmt: skip
        cap = self.settings.max_attempts
        if self.number > cap:
            self.fail(FailureReason.ATTEMPTS_EXHAUSTED, f"execution {self.number} exceeds the cap of {cap} "
                      "(LTX_MAX_ATTEMPTS)", retryable=False, attempts_cap=cap)  # fmt: skip
        lost = int((self.meta.get("retries") or {}).get(FailureReason.WORKER_LOST.value, 0))
        if lost_before and lost > self.outcomes.budget(FailureReason.WORKER_LOST):
            # (executions that vanish unrecorded spend the worker_lost budget like recorded losses)
            self.fail(FailureReason.WORKER_LOST, f"{lost} executions vanished; the worker_lost budget is spent",
                      retryable=False)  # fmt: skip

    def out_of_memory_retries(self) -> int:
        """How often earlier executions of this job ran out of memory (each moves it one memory plan down)."""
        retries = self.meta.get("retries") if isinstance(self.meta.get("retries"), dict) else {}
        return int(retries.get(FailureReason.OUT_OF_MEMORY.value) or 0)

    # ==== poison (worker.jobs.poison) =====================================================================
    def check_poison(self, group: str) -> None:
        """A job whose renders poisoned fleets is not rendered again (re-pushed by id): fail it for good."""
        refused = poison.refusal(self.record.connection, self.id, self.settings.retry_fleet_failure, group=group)
        if refused:
            self.fail(FailureReason.FLEET_FAILURE, refused, retryable=False, poisoned=True)

    def poisoned(self, fleet_reason: str | None, *, group: str, lasting: bool) -> str | None:
        """Record that this attempt's render poisoned `group`'s fleet; why the job must not run again, if so."""
        entries = poison.record(self.record.connection, self.id, fleet_reason, self.failure_ttl(), group=group,
                                lasting=lasting)  # fmt: skip
        return poison.refusal(self.record.connection, self.id, self.settings.retry_fleet_failure, entries, group=group)

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

    def check_cancelled(self) -> None:
        """Record and raise the cancel if a client asked for one."""
        if self.cancel.is_set():
            self.cancelled()

    # ==== ends in the job function (these raise what RQ's failure handling sees) ==========================
    def cancelled(self) -> NoReturn:
        self.outcomes.cancelled(self.record, self.relay)
        raise JobCancelledByClient(f"job {self.id} cancelled")

    def fail(self, reason: FailureReason, message: str, *, retryable: bool | None = None,
             reraise: BaseException | None = None, **details: Any) -> NoReturn:  # fmt: skip
        """Record the failed attempt (retrying or terminal) and raise: `reraise` if given, else `JobFailed`."""
        retry = self.outcomes.failed(self.record, reason, message, relay=self.relay, retryable=retryable, **details)
        if reraise is not None:
            raise reraise
        raise JobFailed(reason, message, retrying=retry, **details) from None

    def spool_failed(self, exc: OSError, where: str = "spool") -> NoReturn:
        """The spool (or the LoRA cache) could not hold this job's files (ENOSPC, EIO, ...): a failure with its
        reason and errno, re-queued within `retry_spool_error` (another host may have room), never an
        unrecorded loop."""
        code = errno.errorcode.get(exc.errno or 0)
        message = f"{where}: {exc.strerror or exc} ({code or type(exc).__name__})"
        retryable = exc.errno != errno.ENAMETOOLONG
        self.fail(FailureReason.SPOOL_ERROR, message, errno=code, retryable=retryable)

    def wait_for_room(self, exc: OSError) -> NoReturn:
        """The LoRA cache has no room for this job's files now (others' jobs pin them, or its disk is short):
        a wait, not a failure. The job goes back to its queue (behind the jobs waiting there) without spending
        a retry budget or an execution of the hard cap, for up to `lora_cache_wait_s` from its first wait;
        after that it fails like `spool_failed`."""
        message = f"lora cache: {exc.strerror or exc}"
        if self.outcomes.deferred(self.record, message, relay=self.relay):
            raise JobFailed(FailureReason.SPOOL_ERROR, message, retrying=True, deferred=True) from None
        self.spool_failed(exc, where="lora cache")

    # ==== ends after the job function returned (the stages) ================================================
    def failed_after_return(self, reason: FailureReason, message: str, *, retryable: bool | None = True,
                            **details: Any) -> bool:  # fmt: skip
        """Record a failed attempt of a job RQ saw finish (it returned at `rendering`/`rendered`), then move it
        back by hand: re-queued within its budget, else failed in RQ. Returns True when re-queued."""
        retry = self.outcomes.failed(self.record, reason, message, relay=self.relay, retryable=retryable, **details)
        if retry:
            token = uuid.uuid4().hex
            with_redis_retry(lambda: self.record.requeue_after_return(token))
        else:  # (retried like the success: a lost reply can at worst leave a second failure result)
            final, ttl, worker = f"JobFailed: {reason.value}: {message}", self.failure_ttl(), self.outcomes.worker_name
            with_redis_retry(lambda: self.record.fail_after_return(final, ttl, worker))
        return retry

    def uploaded(self, result: dict[str, Any]) -> None:
        """Record success (`uploaded`, with the result and the result TTL)."""
        self.outcomes.uploaded(self.record, self.relay, result)

    # ==== TTLs (the worker's, never the enqueuer's: worker.jobs.outcomes) ===================================
    def result_ttl(self) -> int:
        return self.outcomes.result_ttl(self.record)

    def kept_result_ttl(self) -> int:
        return self.outcomes.kept_result_ttl(self.record)

    def failure_ttl(self) -> int:
        return self.outcomes.failure_ttl(self.record)
