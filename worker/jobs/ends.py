"""How an attempt ends other than by success, as values: whatever finds the end (the service, the drive of the
fleet, a stage, a cleanup) returns a `Failure` or a `Cancelled` instead of ending the job itself, and the attempt
decides and records it in one place (`worker.jobs.attempt.JobAttempt.record`, `conclude`, `ended_after_return`).
`JobFailed` and `JobCancelledByClient` are how the job function tells RQ's failure handling an end it recorded
(`JobAttempt.conclude` raises them; the RQ wing's `endings` reads them).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any

from ltx_contract.states import FailureReason
from worker.errors import WorkerError

__all__ = ["CANCELLED", "Cancelled", "End", "Failure", "JobCancelledByClient", "JobFailed"]


@dataclass(frozen=True)
class Failure:
    """An attempt that failed: its reason, the message clients see, and what decides the retry."""

    reason: FailureReason
    message: str
    #: False: never re-queued; None: the reason's budget decides (and the error says whether it allows any)
    retryable: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)  #: the error's machine-readable rest
    #: what ended it, raised again once the end is recorded (RQ's death penalty, a cold stop: RQ must see them)
    reraise: BaseException | None = None
    #: a wait for room, not a failure: re-queued without spending a budget or an execution while the wait lasts
    #: (`lora_cache_wait_s`), then `then`
    then: Failure | None = None

    @classmethod
    def spool(cls, exc: OSError, where: str = "spool") -> Failure:
        """The spool (or the LoRA cache) could not hold this job's files (ENOSPC, EIO, ...): its reason and errno,
        re-queued within `retry_spool_error` (another host may have room), never an unrecorded loop; a name too
        long for the file system is no host's to fix."""
        code = errno.errorcode.get(exc.errno or 0)
        message = f"{where}: {exc.strerror or exc} ({code or type(exc).__name__})"
        return cls(
            FailureReason.SPOOL_ERROR, message, retryable=exc.errno != errno.ENAMETOOLONG, details={"errno": code}
        )

    @classmethod
    def no_room(cls, exc: OSError) -> Failure:
        """The LoRA cache has no room for this job's files now (others' jobs pin them, or its disk is short): a
        wait, then, once it is over, a spool failure of the LoRA cache."""
        message = f"lora cache: {exc.strerror or exc}"
        return cls(FailureReason.SPOOL_ERROR, message, details={"deferred": True}, then=cls.spool(exc, "lora cache"))


@dataclass(frozen=True)
class Cancelled:
    """An attempt a client cancelled (terminal, never retried); `details` go into its `cancelled` state event."""

    details: dict[str, Any] = field(default_factory=dict)


CANCELLED = Cancelled()  #: a cancel of the running attempt
End = Failure | Cancelled


class JobFailed(WorkerError):
    """A job ended in failure; `reason` is a `FailureReason`, `details` the machine-readable rest."""

    def __init__(self, reason: FailureReason, message: str, *, retrying: bool = False, **details: Any) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.retrying = retrying
        self.details = details


class JobCancelledByClient(WorkerError):
    """The job was cancelled by a client; the RQ wing records it `canceled` (not RQ's `stopped`, a failure)."""
