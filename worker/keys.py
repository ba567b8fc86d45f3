"""Redis names, job states, event types and failure reasons of the render service, in one place.

Imports only the standard library so the producer (and any non-Python client that reads this file as
documentation) can share it without pulling in torch, rq or boto3.

Redis layout (besides RQ's own `rq:*` keys; RQ is used with its JSON serializer, so every RQ value is
JSON too):

| key                              | type   | written by | what                                           |
|----------------------------------|--------|------------|------------------------------------------------|
| `rq:job:<id>` field `meta`       | hash   | worker     | JSON summary: see `SUMMARY_FIELDS`             |
| `rq:job:<id>` field `ltx_cancel_requested` | hash | a client | a cancel without PUBLISH (`CANCEL_REQUESTED_FIELD`) |
| `ltx:job:<id>:events`            | stream | worker     | one entry per event (fields `type`, `data`)    |
| `ltx:worker:<name>:health`       | string | worker     | JSON health snapshot, expires with the worker  |
| `rq:queue:<queue>`               | list   | worker, operators | the shared queue: no tenant may write it |
| `rq:queue:<queue>:t:<tenant>`    | list   | tenant `<tenant>` | its own queue (`tenant_queue`): ids only it can push |
| `rq:queues`                      | set    | worker     | the queues workers serve (tenants may not add to it) |

Tenant queues (`LTX_TENANTS`): every tenant pushes only onto its own RQ queue `<queue>:t:<tenant>` (one per
configured queue, so priorities hold), each with RQ's own registries (`rq:wip:<queue>:t:<tenant>`, ...).
Workers serve the shared queue and every tenant queue of each configured queue, tenants in turn, and check
each id before it counts or runs (`worker.tenantqueues`): what a tenant pushes lands where only its own
jobs are counted.

The event stream is capped with `XADD ... MAXLEN ~ events_maxlen` and expires with the job (result TTL
on success, failure TTL otherwise). The health key is refreshed with RQ's heartbeat.

Job lifecycle (`JobState`, stored in meta `state` and announced by `state` events):
`queued → started → rendering → rendered → uploading → uploaded` on success; any state → `failed`
(with a `FailureReason`) or `cancelled`; `retrying` when the worker re-queues the job itself (then the
next attempt starts again at `started`). The terminal states are `uploaded`, `failed`, `cancelled`.
A client waiting for the video waits for `uploaded`, never for RQ's `finished` alone: with the
background uploader (`worker/pipeline.py`) the RQ job finishes at `rendered` and the upload completes afterwards.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

__all__ = [
    "ANONYMOUS_CLIENT",
    "CANCEL_REQUESTED_FIELD",
    "EVENTS_KEY_TEMPLATE",
    "EVENT_FIELD_DATA",
    "EVENT_FIELD_TYPE",
    "JOB_ID_MAX_LEN",
    "KEY_PREFIX",
    "RECORDED_END_STATES",
    "REFUSALS_KEY",
    "RENDER_COMPLETE_STATES",
    "RENDER_FUNC",
    "RQ_ENDED_STATUSES",
    "RUNNING_STATES",
    "S3_SECRET_FILE_FIELDS",
    "SUMMARY_FIELDS",
    "TENANT_QUEUE_INFIX",
    "TERMINAL_STATES",
    "WORKER_HEALTH_KEY_TEMPLATE",
    "EventType",
    "FailureReason",
    "JobState",
    "base_queue",
    "check_client_name",
    "check_job_id",
    "check_queue_names",
    "check_redis_url",
    "check_tenant_name",
    "derive_state",
    "events_key",
    "job_owner",
    "job_tenant",
    "queue_tenant",
    "read_secret_file",
    "safe_redis_url",
    "split_list",
    "tenant_job_id",
    "tenant_queue",
    "worker_health_key",
]

KEY_PREFIX = "ltx"

#: The dotted path producers enqueue (`queue.enqueue(RENDER_FUNC, request_dict, ...)`); RQ resolves it in
#: the worker, so the producer never imports the worker.
RENDER_FUNC = "worker.job.render"

EVENTS_KEY_TEMPLATE = KEY_PREFIX + ":job:{job_id}:events"

#: Longest job id accepted (by the producer at submit and by the worker before it runs a job). An id names
#: a spool directory, an S3 key and Redis keys, and tags every log line of its job: an unbounded one broke
#: the spool (`File name too long`) and flooded the log.
JOB_ID_MAX_LEN = 128
_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")


def check_job_id(job_id: str) -> str:
    """`job_id` if it is 1-`JOB_ID_MAX_LEN` letters, digits, `_` or `-`; else ValueError (never echoes more
    than the start of a long id)."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= JOB_ID_MAX_LEN or not _JOB_ID.fullmatch(job_id):
        shown = repr(job_id[:40]) + ("..." if len(job_id) > 40 else "") if isinstance(job_id, str) else repr(job_id)
        raise ValueError(f"job id {shown} ({len(job_id) if isinstance(job_id, str) else '?'} characters): "
                         f"use 1-{JOB_ID_MAX_LEN} letters, digits, _ or -")  # fmt: skip
    return job_id


# ==== tenant job ids (`<tenant>-<id>`): Redis ACL users own their keys by this prefix ==================

_TENANT_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")


def check_tenant_name(name: str) -> str:
    """`name` if it can own Redis keys by prefix (job ids `<name>-<id>`, ACL key patterns
    `rq:job:<name>-*`): 1-32 letters, digits or `_`. No `-` and no `.`, so tenant `alice`'s `alice-*` never
    matches another tenant's keys (`alice_x-1`); else ValueError."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {str(name)[:40]!r}: use 1-32 letters, digits or _ (no - or .)")
    return name


def tenant_job_id(tenant: str, job_id: str) -> str:
    """`job_id` in `tenant`'s namespace: `<tenant>-<job_id>`, unless it already starts with `<tenant>-`."""
    prefix = check_tenant_name(tenant) + "-"
    return job_id if job_id.startswith(prefix) else prefix + job_id


def job_tenant(job_id: str) -> str | None:
    """The tenant a tenant-namespaced job id belongs to (its part before the first `-`), or None."""
    head, sep, rest = job_id.partition("-")
    return head if sep and rest and _TENANT_NAME.fullmatch(head) else None


#: Infix of a tenant's own queue: `<queue>:t:<tenant>` (configured queue names may not contain it).
TENANT_QUEUE_INFIX = ":t:"


def tenant_queue(queue: str, tenant: str) -> str:
    """The RQ queue name of `tenant`'s own queue for the configured `queue` (idempotent)."""
    suffix = TENANT_QUEUE_INFIX + check_tenant_name(tenant)
    return queue if queue.endswith(suffix) else queue + suffix


def queue_tenant(queue: str) -> str | None:
    """The tenant owning the RQ queue `queue` (`<queue>:t:<tenant>`), None for a shared queue."""
    head, sep, tenant = queue.rpartition(TENANT_QUEUE_INFIX)
    return tenant if sep and head and _TENANT_NAME.fullmatch(tenant) else None


def base_queue(queue: str) -> str:
    """The configured queue a tenant queue belongs to (the queue itself when shared)."""
    return queue.rpartition(TENANT_QUEUE_INFIX)[0] if queue_tenant(queue) else queue


#: Job-hash field a client sets to cancel a job without `PUBLISH` or access to the shared queue list (a
#: tenant's Redis user: `worker.control`). Workers skip a dequeued job that carries it and stop a running
#: one at the next heartbeat. Neither RQ nor the worker ever writes or clears it, so no save can undo it.
CANCEL_REQUESTED_FIELD = KEY_PREFIX + "_cancel_requested"

WORKER_HEALTH_KEY_TEMPLATE = KEY_PREFIX + ":worker:{name}:health"

#: Jobs a worker took out of its queues without running them (over the depth cap or a client's quota),
#: waiting to be recorded as failed (`worker.admission`): a list of JSON objects.
REFUSALS_KEY = KEY_PREFIX + ":worker:refusals"

# ==== job owners (the client a job counts against; checked by the producer and by the worker) =========

#: The owner of a job whose meta names no `client` (enqueued without the producer).
ANONYMOUS_CLIENT = "anonymous"
_CLIENT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")

#: RQ statuses after which a job no longer counts as unfinished (for quotas, on both sides).
RQ_ENDED_STATUSES = frozenset({"finished", "failed", "stopped", "canceled"})


def check_client_name(client: str) -> str:
    """`client` if it is 1-64 letters, digits or `_.@-` (it becomes part of a Redis key and is shown to
    operators); else ValueError (a 10k-character name and `"x:*\\nFAKE"` passed the API before)."""
    if not isinstance(client, str) or not _CLIENT_NAME.fullmatch(client):
        raise ValueError(f"client name {str(client)[:40]!r}: use 1-64 letters, digits or _.@-")
    return client


def job_owner(meta: Any) -> str:
    """The client a job counts against: its meta `client` (written by the producer), checked by
    `check_client_name` (ValueError if malformed); a job whose meta names none is `ANONYMOUS_CLIENT`'s."""
    client = meta.get("client") if isinstance(meta, dict) else None
    return ANONYMOUS_CLIENT if client is None else check_client_name(client)


#: Stream entry fields: `type` (an `EventType` value, for cheap filtering) and `data` (the whole event as
#: a JSON object, which repeats `type` and adds `ts`, the worker's wall-clock time in seconds).
EVENT_FIELD_TYPE = "type"
EVENT_FIELD_DATA = "data"


def events_key(job_id: str) -> str:
    """The Redis Stream holding a job's events."""
    return EVENTS_KEY_TEMPLATE.format(job_id=job_id)


def worker_health_key(name: str) -> str:
    return WORKER_HEALTH_KEY_TEMPLATE.format(name=name)


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
    #: renders poisoned a fleet more often than that allows or once for a lasting cause (`worker.poison`;
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
)


# ==== settings shared by the worker and the producer (both read the same LTX_* variables) ===========

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def split_list(value: Any, sep: str) -> Any:
    """An environment value as a list: a JSON array, or items separated by `sep`; other values pass."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(sep) if part.strip()]
    return value


def check_queue_names(names: list[str]) -> list[str]:
    """Queue names become Redis key parts: at least one, and only letters, digits and `_.:-`."""
    if not names:
        raise ValueError("at least one queue is needed")
    for name in names:
        if not _QUEUE_NAME.fullmatch(name):
            raise ValueError(f"queue name {name!r} may only contain letters, digits and _.:-")
        if TENANT_QUEUE_INFIX in name:
            raise ValueError(f"queue name {name!r}: {TENANT_QUEUE_INFIX!r} is reserved for tenant queues")
    return names


def safe_redis_url(url: str) -> str:
    """The Redis URL without its password, for messages and logs."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


#: (secret field, field naming a file that holds it): the S3 key pairs both settings classes read from files
#: (`LTX_S3_ACCESS_KEY_ID_FILE`, ...: compose secrets); a file wins over the plain variable.
S3_SECRET_FILE_FIELDS = (
    ("s3_access_key_id", "s3_access_key_id_file"),
    ("s3_secret_access_key", "s3_secret_access_key_file"),
)


def read_secret_file(path: Any, file_field: str) -> str:
    """The stripped contents of a secret file; ValueError naming the setting (never the contents)."""
    from pathlib import Path

    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{file_field} (LTX_{file_field.upper()}): cannot read {path}: {exc.strerror}") from None


def check_redis_url(url: str) -> str:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must start with redis://, rediss:// or unix://")
    return url
