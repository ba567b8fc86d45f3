"""Error types of the control plane, each named for how a caller recovers from it.

How each error tells the caller to recover:
- `RunnerError` (raised inside a runner): a recoverable failure; raise it on every rank, outside collectives.
- `RenderFault` (a `RunnerError`): a rank's render raised something else that is not a fleet-level fault
  (a bug, an overflow: `TypeError`, `RuntimeError`, ...); the rank ended the job and stays in the fleet.
  `RenderOutOfMemory`: the same for `torch.OutOfMemoryError`, after the rank released what the job held.
- `SymmetricRunnerError`: every rank ended the job with a `RunnerError`. Fleet alive: fix the input, retry.
- `JobCancelledError`: the job was cancelled cooperatively on every rank. Fleet alive.
- `AsymmetricRunnerError`: some ranks raised `RunnerError`, others finished. Fleet alive, but treat it as a
  failure and investigate (a latent hang risk).
- `ControllerBusyError`: another job is still in flight. Fleet alive: drain it first.
- `FleetFailure`: a rank died, a job timed out, the fleet desynced. Poisoned: build a new controller.
"""

from __future__ import annotations

import time

from ..errors import LtxMgpuError
from ..spec.request_rules import RequestRuleError  # (what a rank turns into `RequestRefused`: `rank_faults.job_error`)

__all__ = [
    "AsymmetricRunnerError",
    "ControllerBusyError",
    "FleetFailure",
    "FleetTimeoutError",
    "JobCancelledError",
    "RenderFault",
    "RenderOutOfMemory",
    "RequestRefused",
    "RequestRuleError",
    "RunnerCancelled",
    "RunnerError",
    "SymmetricRunnerError",
    "value_error_terminal",
]


class RunnerError(LtxMgpuError):
    """Recoverable runner failure. Must be raised identically on every rank and outside any collective."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.message,))


class RequestRefused(RunnerError):
    """The runner's request rules refused the job's arguments (`ltx_mgpu.spec.request_rules.RequestRuleError` on a
    rank): the request is wrong, not the runner (a service reports it as `invalid_request`); `field` names it."""

    def __init__(self, message: str, field: str = "(request)") -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # type: ignore[override]
        return (type(self), (self.message, self.field))


def value_error_terminal(err: ValueError, text: str) -> RunnerError:
    """What a rank reports for a `ValueError` that ended its job: the request rules' refusal
    (`RequestRuleError`) as `RequestRefused` (the client's request), any other as a `RunnerError`."""
    return RequestRefused(text, err.field) if isinstance(err, RequestRuleError) else RunnerError(text)


class RenderFault(RunnerError):
    """A render raised `exc_type` (not a `RunnerError`/`ValueError`, not a fleet-level fault) on one rank.

    The rank reported it as the job's end and took the next job; its traceback went to the rank's log only
    (a job's error is read by its client, a traceback may hold another job's data). Raised on every rank it
    is a `SymmetricRunnerError` like any other; on some ranks only, the controller gives the others
    `MGPUController(error_settle_s=...)` to end the job too, else it poisons the fleet (they may be blocked
    in a collective the raising ranks left)."""

    def __init__(self, message: str, exc_type: str = "Exception") -> None:
        super().__init__(message)
        self.exc_type = exc_type

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # type: ignore[override]
        return (type(self), (self.message, self.exc_type))


class RenderOutOfMemory(RenderFault):
    """A render ran out of device (or host) memory on a rank; the rank dropped the job's references and
    emptied its allocator cache before reporting, so the fleet can take the next job."""


class RunnerCancelled(RunnerError):
    """Raised on every rank by `MGPURunner.raise_if_cancelled()` once the rank-0 decision says so."""


class SymmetricRunnerError(LtxMgpuError):
    """Every rank ended its job with a `RunnerError`; the fleet is alive and can take the next job."""

    def __init__(self, errors: list[RunnerError]) -> None:
        self.errors = errors
        super().__init__(errors[0].message if errors else "runner error")

    @property
    def request_refused(self) -> RequestRefused | None:
        """The refusal, when every rank's error is the request rules refusing the job (else None)."""
        if self.errors and all(isinstance(e, RequestRefused) for e in self.errors):
            return self.errors[0]  # type: ignore[return-value]
        return None

    @property
    def out_of_memory(self) -> bool:
        """A rank ran out of memory (a retry may fit once the memory is free; the request itself is valid)."""
        return any(isinstance(e, RenderOutOfMemory) for e in self.errors)


class JobCancelledError(SymmetricRunnerError):
    """The job was cancelled (`Stream.cancel()`); every rank stopped at a safe point, the fleet is alive."""


class AsymmetricRunnerError(LtxMgpuError):
    """Some ranks raised `RunnerError` and others finished cleanly; the fleet is alive but the runner has a
    latent hang risk (a rank that skipped a collective the others entered would deadlock)."""

    def __init__(self, terminals: list[BaseException]) -> None:
        self.terminals = terminals
        super().__init__("runner raised RunnerError on some ranks but not all")


class ControllerBusyError(LtxMgpuError, RuntimeError):
    """A job is still in flight: consume it (iterate or `drain()`) or shut the controller down."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"MGPU job {job_id} is still in flight; consume it (stream.drain()) first.")


class FleetFailure(LtxMgpuError, RuntimeError):
    """The fleet can no longer be trusted (dead rank, timeout, desync, shutdown mid-job).

    The controller is poisoned: every later `stream()` raises "MGPUController is dead; create a new one.".
    `rank`, `pid` and `exitcode` name the first failed rank when one is known; `reason` is a short
    machine-readable tag: "rank_failed", "rank_exited", "timeout", "desync", "split" (some ranks ended a
    job with an error, the others did not end it within the settle time) or "shutdown".
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        rank: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.detected_at = time.time()  #: wall-clock time the controller noticed the failure
        self.reason = reason
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode


class FleetTimeoutError(FleetFailure, TimeoutError):
    """A job exceeded its `timeout` (or startup exceeded its own); a `TimeoutError` as well."""
