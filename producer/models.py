"""What the producer's client returns and raises: job views, events, stats rows, errors, and the small
decoders that build them from Redis (a job hash that cannot be read becomes an `unreadable` row)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from ltx_contract.health import WorkerHealth
from ltx_contract.keys import EVENT_FIELD_DATA, EVENT_FIELD_TYPE
from ltx_contract.redis_conn import redis_problem
from ltx_contract.schema import RenderRequest
from ltx_contract.states import TERMINAL_STATES, EventType
from producer.errors import ProducerError

#: The terminal service states as plain strings (what meta and events carry).
TERMINAL_VALUES = {s.value for s in TERMINAL_STATES}


class ServiceUnavailable(ProducerError, RuntimeError):
    """Redis (or storage) cannot be reached or used.

    `misconfigured`: the server answered and refused us (credentials, ACL, no such database, not Redis at
    all, TLS): the settings are wrong, so waiting or working offline (`submit --dry-run`) does not help."""

    def __init__(self, message: str, *, misconfigured: bool = False) -> None:
        super().__init__(message)
        self.misconfigured = misconfigured


class InvalidJobId(ProducerError, ValueError):
    """A job id no job can have (`ltx_contract.keys.check_job_id`): a usage error, never a lookup."""


class FetchRefused(ProducerError, RuntimeError):
    """`fetch` will not download from where the job's result points (not the configured endpoint): a
    configuration question, not a failed integrity check."""


class JobNotFound(ProducerError, LookupError):
    """No job with this id (never submitted, or expired after its TTL)."""


class JobUnreadable(JobNotFound):
    """A job hash that cannot be read (written by hand, or by a broken client): `ls` and `stats` show it as
    a note instead of failing for everyone."""

    def __init__(self, job_id: str, exc: BaseException) -> None:
        super().__init__(f"job {job_id!r} exists but cannot be read: {type(exc).__name__}: {str(exc)[:200]}")
        self.job_id = job_id


class JobNotReady(ProducerError, RuntimeError):
    """`fetch` on a job whose video is not in storage (yet, or ever: see `state`)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"job {job_id} has no video to fetch: state is {state!r}")
        self.state = state


class IntegrityError(ProducerError, RuntimeError):
    """Downloaded bytes do not hash to the sha256 the worker recorded."""


def content_job_id(request: RenderRequest, *, prefix: str = "bf") -> str:
    """A job id derived from the request's content (prompt, sizes, seed, ...): same request, same id.

    The canonical JSON includes defaults, so `{"prompt": "x"}` and `{"prompt": "x", "seed": 42}` are one
    job. RQ job ids may only contain letters, digits, `_` and `-`.
    """
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return f"{prefix}-{hashlib.sha256(canonical.encode()).hexdigest()[:32]}"


# ==== data returned to callers ==========================================================================


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's event stream."""

    id: str  #: the Redis Stream entry id ("<ms>-<seq>"); resume after it
    type: str  #: a `ltx_contract.states.EventType` value
    data: dict[str, Any]  #: the whole event (includes `type` and the worker's `ts`)

    @property
    def terminal_state(self) -> str | None:
        """The terminal state this event announces, if any."""
        if self.type == EventType.STATE.value and self.data.get("state") in TERMINAL_VALUES:
            return str(self.data["state"])
        return None


@dataclass(frozen=True)
class JobInfo:
    """Everything `status` shows about one job."""

    job_id: str
    state: str  #: service state (`ltx_contract.states.JobState` value)
    rq_status: str | None  #: RQ's own status
    queue: str | None
    meta: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    request: dict[str, Any] | None
    enqueued_at: datetime | None  #: first submission (a retry re-queues the job; see `requeued_at`)
    started_at: datetime | None  #: start of the latest attempt
    ended_at: datetime | None  #: when the job reached its terminal state (the upload's end, not the render's)
    requeued_at: datetime | None = None  #: the latest re-queue after a failed attempt, if any

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_VALUES

    def as_json(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return value.isoformat() if value else None

        summary = {k: self.meta.get(k) for k in ("stage", "step", "total", "percent", "eta_s", "attempt")}
        return {
            "job_id": self.job_id,
            "state": self.state,
            "rq_status": self.rq_status,
            "queue": self.queue,
            **summary,
            "worker": self.meta.get("worker"),
            "fleet": self.meta.get("fleet"),
            "enqueued_at": iso(self.enqueued_at),
            "requeued_at": iso(self.requeued_at),
            "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at),
            "attempts": self.meta.get("attempts") or [],
            # what was rendered: sha256 of the frames and the audio (from `rendered` on), beside the mp4's
            "digests": self.meta.get("digests"),
            # the fleet's deterministic mode ("on", "strict", "off"): equal digests are promised only under it
            "deterministic": self.meta.get("deterministic"),
            # the request's LoRAs as this job used them (cached or bytes fetched) and the fleet's swap time
            "loras": self.meta.get("loras") if isinstance(self.meta.get("loras"), list) else [],
            "lora_swap_s": self.meta.get("lora_swap_s"),
            "error": self.error,
            "result": self.result,
            "request": self.request,
        }


@dataclass(frozen=True)
class FetchResult:
    path: Path
    size: int
    sha256: str
    source: str  #: where the bytes came from (s3://bucket/key or the URL without its signature)


@dataclass(frozen=True)
class QueueStats:
    name: str
    queued: int
    started: int
    finished: int
    failed: int
    canceled: int
    deferred: int
    scheduled: int


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    state: str  #: RQ worker state (idle, busy, ...)
    queues: list[str]
    current_job: str | None
    group: str | None  #: the device group from the worker's health snapshot
    fleet_state: str | None
    last_heartbeat: datetime | None
    health: WorkerHealth | None  #: the worker's whole health snapshot, if it wrote a readable one
    health_error: str | None = None  #: why its snapshot could not be read (one line), if it could not


@dataclass(frozen=True)
class FailureInfo:
    job_id: str
    queue: str
    reason: str | None
    message: str
    ended_at: datetime | None


@dataclass(frozen=True)
class Stats:
    queues: list[QueueStats]
    workers: list[WorkerInfo]
    failures: list[FailureInfo]
    max_queue_depth: int
    client: str
    client_quota: int
    client_unfinished: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        def plain(obj: Any) -> Any:
            if isinstance(obj, datetime):
                return obj.isoformat()
            if isinstance(obj, list):
                return [plain(o) for o in obj]
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            if isinstance(obj, WorkerHealth):
                return obj.to_json()  # (the snapshot's own JSON: the keys the worker wrote)
            if hasattr(obj, "__dataclass_fields__"):
                return {k: plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
            return obj

        return plain(self)


def decode_event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> JobEvent:
    ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    decoded = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
    data: dict[str, Any]
    try:
        data = json.loads(decoded.get(EVENT_FIELD_DATA, "{}"))
    except ValueError:
        data = {"raw": decoded.get(EVENT_FIELD_DATA)}
    if not isinstance(data, dict):
        data = {"value": data}
    etype = decoded.get(EVENT_FIELD_TYPE) or str(data.get("type") or EventType.OTHER.value)
    return JobEvent(id=ident, type=etype, data=data)


#: The `state` of a row standing for a job hash that cannot be read (not a `JobState`: no worker wrote it).
UNREADABLE = "unreadable"


def unreadable_info(job_id: str, queue: str, exc: JobUnreadable) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        state=UNREADABLE,
        rq_status=None,
        queue=queue,
        meta={},
        result=None,
        error={"reason": UNREADABLE, "message": str(exc)},
        request=None,
        enqueued_at=None,
        started_at=None,
        ended_at=None,
    )


@contextlib.contextmanager
def unavailable_on_error(redis_url: str | None = None) -> Iterator[None]:
    """Errors that say Redis itself cannot be used (`redis_problem`) as `ServiceUnavailable` (one line for
    the CLI, exit 6); other Redis errors (about the data: WRONGTYPE, ...) pass through."""
    try:
        yield
    except redis.RedisError as exc:
        problem = redis_problem(exc, redis_url)
        if problem is None:
            raise
        raise ServiceUnavailable(problem[0], misconfigured=problem[1]) from None


# ==== helpers of the client's views =====================================================================


def utc_from(ts: Any) -> datetime | None:
    """A wall-clock timestamp (seconds) from the meta summary as an aware datetime."""
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        return None
    return datetime.fromtimestamp(ts, tz=UTC)


def requeued_at(enqueued: datetime | None, started: datetime | None, meta: dict[str, Any]) -> datetime | None:
    """RQ's `enqueued_at` if it is a re-queue: later than the end of an attempt recorded in meta `attempts`
    (a retry) or than the latest start (RQ's cleanup re-queued a job whose worker vanished). Comparing it
    with `submitted_at` alone called every job re-queued: the producer stamps `submitted_at` just before
    RQ stamps `enqueued_at`."""
    if enqueued is None:
        return None
    attempts = meta.get("attempts")
    ends = [utc_from(a.get("at")) for a in attempts if isinstance(a, dict)] if isinstance(attempts, list) else []
    if any(end is not None and end <= enqueued for end in ends):
        return enqueued
    return enqueued if started is not None and started < enqueued else None


def looks_uploaded(result: dict[str, Any]) -> bool:
    return bool(result.get("sha256")) and bool(result.get("key") or result.get("url") or result.get("path"))


def last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
