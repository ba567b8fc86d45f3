"""Job states, event types, failure reasons and the job summary of the render service, in one place.

Imports only the standard library (the producer shares it).

Job lifecycle (`JobState`, stored in meta `state` and announced by `state` events):
`queued → started → rendering → rendered → uploading → uploaded` on success; any state → `failed`
(with a `FailureReason`) or `cancelled`; `retrying` when the worker re-queues the job itself (then the
next attempt starts again at `started`). The terminal states are `uploaded`, `failed`, `cancelled`.
A client waiting for the video waits for `uploaded`, never for RQ's `finished` alone: with the
background uploader (`worker/stages/upload.py`) the RQ job finishes at `rendered` and the upload completes afterwards.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

__all__ = [
    "RECORDED_END_STATES",
    "RENDER_COMPLETE_STATES",
    "RUNNING_STATES",
    "SUMMARY_FIELDS",
    "TERMINAL_STATES",
    "EventType",
    "FailureReason",
    "JobState",
    "derive_state",
]


class JobState(StrEnum):
    """The service-level state of a render job (RQ's own status is coarser: queued/started/finished/...)."""

    #: Enqueued, not picked up yet (set by the producer; the worker never writes it).
    QUEUED = "queued"
    #: A worker took the job and validated the request; the fleet is about to run it.
    STARTED = "started"
    #: The fleet is running the job (stage/progress events flow).
    RENDERING = "rendering"
    #: The video is complete in the worker's spool (manifest written); not in storage yet.
    RENDERED = "rendered"
    #: The upload to storage is in progress (or being retried).
    UPLOADING = "uploading"
    #: Terminal, success: the object is in storage with a matching sha256; the result names it.
    UPLOADED = "uploaded"
    #: The worker re-queued the job after a retryable failure (see `FailureReason`).
    RETRYING = "retrying"
    #: Terminal: see the `error` object in meta and the last `state` event.
    FAILED = "failed"
    #: Terminal: cancelled by a client (queued: never ran; running: stopped cooperatively).
    CANCELLED = "cancelled"


# ---- state sets: what each state means to whoever reads it (the only definitions; import them) -------

#: The job ended for good: nothing will change it any more.
TERMINAL_STATES = frozenset({JobState.UPLOADED, JobState.FAILED, JobState.CANCELLED})
#: An execution owns the job: a worker took it and has not recorded an end (a state here with no live
#: execution means that execution vanished).
RUNNING_STATES = frozenset({JobState.STARTED, JobState.RENDERING, JobState.RENDERED, JobState.UPLOADING})
#: The render is complete: the video is committed to a host's spool (or already in storage), so the job
#: must never be rendered again; only its upload may be retried.
RENDER_COMPLETE_STATES = frozenset({JobState.RENDERED, JobState.UPLOADING, JobState.UPLOADED})
#: An execution recorded how it ended (terminally, or by re-queueing the job itself).
RECORDED_END_STATES = TERMINAL_STATES | {JobState.RETRYING}

#: RQ statuses that end a job even when no worker wrote a service state (it never ran, its worker
#: vanished, or a client cancelled it while queued), and the service state each one means.
_RQ_STATUS_STATE = {
    "queued": JobState.QUEUED,
    "deferred": JobState.QUEUED,
    "scheduled": JobState.QUEUED,
    "started": JobState.STARTED,
    "failed": JobState.FAILED,
    "stopped": JobState.CANCELLED,
    "canceled": JobState.CANCELLED,
}


def derive_state(rq_status: str | None, meta: dict[str, Any]) -> JobState:
    """A job's service state: the worker's summary (meta `state`), corrected by RQ's status where RQ knows
    better (a job RQ ended that no worker recorded; a job RQ re-queued after its worker vanished)."""
    try:
        state = JobState(meta.get("state"))
    except ValueError:
        state = _RQ_STATUS_STATE.get(rq_status or "", JobState.QUEUED)
    if rq_status in ("failed", "stopped", "canceled") and state not in TERMINAL_STATES:
        state = _RQ_STATUS_STATE[rq_status]  # RQ ended it and no worker said so
    elif rq_status in ("queued", "scheduled", "deferred") and state in RUNNING_STATES:
        state = JobState.QUEUED  # re-queued after its worker vanished mid-job: the summary is stale
    return state


class EventType(StrEnum):
    """`type` of a stream entry. Runner events are relayed unchanged (see `ltx_mgpu/control/events.py`)."""

    #: Service state change: `{"state": JobState, ...}`; terminal ones carry `result` or `error`.
    STATE = "state"
    #: Runner: a stage begins: `{"stage": str}`.
    STAGE = "stage"
    #: Runner: `{"stage", "step", "total"}`; the worker adds `percent` and `eta_s`.
    PROGRESS = "progress"
    #: Runner: the finished file on the driver rank: `{"path", "frames", "fps", "width", "height", "bytes"}`.
    OUTPUT = "output"
    #: Upload progress: `{"bytes", "total"}` (throttled), and `{"attempt", "error", "retry_in_s"}` on retries.
    UPLOAD = "upload"
    #: Fleet supervision: `{"action": "failed" | "rebuilding" | "rebuilt" | "rebuild_failed", ...}`.
    FLEET = "fleet"
    #: Anything else a runner yields that is a dict with an unknown type: relayed as-is.
    OTHER = "other"


class FailureReason(StrEnum):
    """Machine-readable `error.reason` of a failed job; `retryable` says whether a retry could succeed."""

    #: The request failed validation; `error.field` names the offending field. Never retried.
    INVALID_REQUEST = "invalid_request"
    #: The runner rejected the job on every rank (e.g. over its token budget), or its render raised an
    #: unexpected error on every rank (`error.message` starts with the type, e.g. "TypeError: ..."; the fleet
    #: stays up). Never retried.
    RUNNER_ERROR = "runner_error"
    #: Some ranks raised a RunnerError and others did not: a runner bug. Not retried.
    ASYMMETRIC_RUNNER_ERROR = "asymmetric_runner_error"
    #: A rank ran out of memory mid-render; it freed what the job held and the fleet stays up. Retried once.
    OUT_OF_MEMORY = "out_of_memory"
    #: A rank died, the job timed out in the fleet, the fleet desynced, or the render raised on some ranks
    #: while the others waited in a collective: `error.rank`, `error.exitcode`, `error.fleet_reason` say
    #: which. The fleet is rebuilt before the next job. Retried per settings, but never once the job's
    #: renders poisoned a fleet more often than that allows or once for a lasting cause (`worker.jobs.poison`;
    #: `error.poisoned` when refused without rendering).
    FLEET_FAILURE = "fleet_failure"
    #: The render finished but the upload failed after all attempts; the file stays in the spool.
    UPLOAD_FAILED = "upload_failed"
    #: The runner finished without yielding an `output` event (or the file is missing).
    NO_OUTPUT = "no_output"
    #: The worker was stopped cold (second SIGTERM) mid-job. Re-queued per settings.
    WORKER_SHUTDOWN = "worker_shutdown"
    #: A previous attempt's worker vanished (killed) mid-job; RQ's cleanup re-queued it.
    WORKER_LOST = "worker_lost"
    #: RQ's job_timeout fired before the fleet's own timeout (the fleet is rebuilt).
    JOB_TIMEOUT = "job_timeout"
    #: The worker's spool could not hold the render (disk full, I/O error): `error.errno` says which.
    #: Retried per settings (another host may have room); the fleet is untouched.
    SPOOL_ERROR = "spool_error"
    #: The job reached the worker's hard cap on executions (`max_attempts`), whatever the reasons. Never
    #: retried: it bounds any loop the per-reason budgets do not (e.g. executions that vanish unrecorded).
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    #: Taken out of the queue without running: more than `LTX_MAX_QUEUE_DEPTH` jobs were waiting and this
    #: was among the newest (`error.depth`, `error.cap`). Never retried.
    QUEUE_FULL = "queue_full"
    #: Not run: its owner (meta `client`; none: `anonymous`) had `LTX_CLIENT_QUOTA` unfinished jobs ahead of
    #: it (`error.client`, `error.unfinished`, `error.quota`). Never retried.
    QUOTA_EXCEEDED = "quota_exceeded"
    #: A bug in the worker itself.
    INTERNAL = "internal"


#: Keys of the summary the worker keeps in `job.meta` (read with plain RQ: `Job.fetch(id,
#: connection=r, serializer=JSONSerializer).get_meta()`).
SUMMARY_FIELDS = (
    "state",  # JobState value
    "stage",  # current runner stage or None
    "step",  # progress step in the current stage or None
    "total",  # steps in the current stage or None
    "percent",  # 0..100 within the current stage, or None
    "eta_s",  # seconds left in the current stage (from the observed step rate), or None
    "attempt",  # 1 for the first execution, incremented on every (re)start by a worker
    "worker",  # RQ worker name that runs / ran the job
    "fleet",  # the device group, e.g. "cpu:2" or "0,1,2,3"
    "updated_at",  # worker wall-clock seconds of the last summary write
    "ended_at",  # wall-clock seconds of the terminal state (the upload's end, not the render's)
    "error",  # the current failure {"reason", "message", "retryable", "attempts", ...}; None once uploaded
    "result",  # on success: the same JSON object as the RQ job result
    "retries",  # re-queues so far per failure reason: {"fleet_failure": 1, ...} (what the retry budgets count)
    "attempts",  # how each attempt that did not succeed ended: [{"attempt", "worker", "outcome", "reason", ...}]
    "digests",  # sha256 of the rendered frames and audio (`ltx_mgpu.runners.common.digest`), from `rendered` on
    "deterministic",  # the fleet's deterministic mode ("on", "strict", "off"), from `rendering` on
)
