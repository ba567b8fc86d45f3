"""The producer's Python API: submit, status, follow events, cancel, fetch, stats. The CLI is built on it.

It talks to Redis (RQ with its JSON serializer: no pickle crosses Redis) and, for `fetch`, to S3 or a
presigned URL. It knows the worker only through `worker.schema` (the request model) and `worker.keys`
(Redis names, states, event types): both import neither torch nor ltx_mgpu, so this stays a light client.

Which state counts: the service state in the job's meta (`worker.keys.JobState`) is authoritative, with
RQ's coarser status as a fallback when no worker ever wrote one (e.g. a job cancelled while queued, or a
worker that died before it started the job). A job is done when its state is terminal: `uploaded`
(the video is in storage), `failed` or `cancelled`; RQ's `finished` alone is not enough, because the
upload may still be running after the RQ job returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from producer.admission import TERMINAL_STATUSES, AdmissionPolicy, check_client_name, client_key, enqueue_admitted
from producer.settings import ProducerSettings
from worker.control import cancel_job
from worker.keys import (
    EVENT_FIELD_DATA,
    EVENT_FIELD_TYPE,
    RENDER_FUNC,
    TERMINAL_STATES,
    EventType,
    JobState,
    check_job_id,
    derive_state,
    events_key,
    safe_redis_url,
    worker_health_key,
)
from worker.limits import LimitViolation, RunnerLimits
from worker.renderjob import RenderJob
from worker.schema import RenderRequest

__all__ = [
    "FetchResult",
    "IntegrityError",
    "JobEvent",
    "JobInfo",
    "JobNotFound",
    "JobNotReady",
    "JobUnreadable",
    "ProducerClient",
    "QueueStats",
    "ServiceUnavailable",
    "Stats",
    "WorkerInfo",
    "content_job_id",
]

_TERMINAL = {s.value for s in TERMINAL_STATES}


class ServiceUnavailable(RuntimeError):
    """Redis (or storage) cannot be reached."""


class JobNotFound(LookupError):
    """No job with this id (never submitted, or expired after its TTL)."""


class JobUnreadable(JobNotFound):
    """A job hash that cannot be read (written by hand, or by a broken client): `ls` and `stats` show it as
    a note instead of failing for everyone."""

    def __init__(self, job_id: str, exc: BaseException) -> None:
        super().__init__(f"job {job_id!r} exists but cannot be read: {type(exc).__name__}: {str(exc)[:200]}")
        self.job_id = job_id


class JobNotReady(RuntimeError):
    """`fetch` on a job whose video is not in storage (yet, or ever: see `state`)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"job {job_id} has no video to fetch: state is {state!r}")
        self.state = state


class IntegrityError(RuntimeError):
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
    type: str  #: a `worker.keys.EventType` value
    data: dict[str, Any]  #: the whole event (includes `type` and the worker's `ts`)

    @property
    def terminal_state(self) -> str | None:
        """The terminal state this event announces, if any."""
        if self.type == EventType.STATE.value and self.data.get("state") in _TERMINAL:
            return str(self.data["state"])
        return None


@dataclass(frozen=True)
class JobInfo:
    """Everything `status` shows about one job."""

    job_id: str
    state: str  #: service state (`worker.keys.JobState` value)
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
        return self.state in _TERMINAL

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
    health: dict[str, Any] | None  #: the worker's whole health snapshot, if it wrote one


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
            if hasattr(obj, "__dataclass_fields__"):
                return {k: plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
            return obj

        return plain(self)


# ==== the client ========================================================================================


class ProducerClient:
    """A connection to the render service. Cheap to create; thread-safe like redis-py itself."""

    def __init__(self, settings: ProducerSettings, *, connection: redis.Redis | None = None) -> None:
        self.settings = settings
        self.connection = connection or redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=15
        )

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> ProducerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submit ------------------------------------------------------------------------------------
    def queue(self, name: str | None = None) -> Queue:
        return Queue(name or self.settings.default_queue, connection=self.connection, serializer=JSONSerializer)

    def submit(
        self,
        request: RenderRequest,
        *,
        queue: str | None = None,
        priority: str = "normal",
        job_id: str | None = None,
        client: str | None = None,
        max_queue_depth: int | None = None,
        client_quota: int | None = None,
        extra_meta: dict[str, Any] | None = None,
    ) -> Job:
        """Enqueue one render under admission control; returns the RQ job.

        `priority="high"` puts the job at the front of its queue. Raises `AdmissionRefused` (queue full or
        quota used up), `DuplicateJobError` (a `job_id` that exists), `ServiceUnavailable`, ValueError (a
        `job_id` that `worker.keys.check_job_id` refuses).
        """
        if priority not in ("normal", "high"):
            raise ValueError(f"priority must be 'normal' or 'high', got {priority!r}")
        if job_id is not None:
            check_job_id(job_id)  # (the worker refuses it too; RQ checks only the characters)
        s = self.settings
        client = check_client_name(client or s.client)
        depth = s.max_queue_depth if max_queue_depth is None else max_queue_depth
        quota = s.client_quota if client_quota is None else client_quota
        policy = AdmissionPolicy(max_queue_depth=depth or None, client_quota=quota or None)
        q = self.queue(queue)
        meta = {"state": JobState.QUEUED.value, "client": client, "submitted_at": time.time(), **(extra_meta or {})}
        if len(json.dumps(meta)) > RenderJob.max_meta_bytes:  # (the worker refuses it too, per its settings)
            raise ValueError(f"extra_meta: the job's meta would exceed {RenderJob.max_meta_bytes} bytes")
        with _unavailable_on_error():
            job = q.create_job(
                RENDER_FUNC,
                args=(request.model_dump(mode="json"),),
                job_id=job_id,
                timeout=s.job_timeout,
                result_ttl=s.result_ttl,
                failure_ttl=s.failure_ttl,
                description=f"render {request.prompt[:60]!r}",
                meta=meta,
            )
            counted = [self.queue(name) for name in dict.fromkeys([*s.queues, q.name])]
            return enqueue_admitted(
                q, job, policy=policy, counted_queues=counted, client=client, at_front=priority == "high"
            )

    def runner_limits(self, queue: str | None = None) -> list[tuple[str, RunnerLimits]]:
        """The request limits the live workers on `queue` publish (worker name, limits); see worker.limits."""
        out: list[tuple[str, RunnerLimits]] = []
        with _unavailable_on_error():
            for worker in Worker.all(connection=self.connection, queue=self.queue(queue)):
                raw = self.connection.get(worker_health_key(worker.name))
                try:
                    health = json.loads(raw) if raw else {}
                except ValueError:
                    continue
                limits = RunnerLimits.from_json(health.get("limits")) if isinstance(health, dict) else None
                if limits is not None:
                    out.append((worker.name, limits))
        return out

    @staticmethod
    def limit_violations(request: RenderRequest, limits: list[tuple[str, RunnerLimits]]) -> list[LimitViolation]:
        """What any of these workers would reject in `request` (any of them may take the job)."""
        seen: dict[tuple[str, str], LimitViolation] = {}
        for _, published in limits:
            for v in published.violations(request):
                seen.setdefault((v.field, v.runner), v)
        return list(seen.values())

    # ---- status ------------------------------------------------------------------------------------
    def job(self, job_id: str) -> Job:
        """The RQ job (loaded as the worker loads it: `RenderJob` bounds what it decompresses)."""
        with _unavailable_on_error():
            try:
                return RenderJob.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
            except NoSuchJobError:
                raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)") from None
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception as exc:  # RQ's parse errors: DeserializationError, ValueError, TypeError, ...
                raise JobUnreadable(job_id, exc) from None

    def status(self, job_id: str) -> JobInfo:
        """The job's state and records. Raises JobNotFound (also for another client's job, unless this
        client is an operator), JobUnreadable (a hash that cannot be read)."""
        info = self._read(job_id)
        if not self._visible(info):
            raise JobNotFound(f"no job {job_id!r} of client {self.settings.client!r} (another client's job; "
                              "operators, LTX_OPERATOR=true, see every job)")  # fmt: skip
        return info

    def _visible(self, info: JobInfo) -> bool:
        """Tenancy, as far as a client can enforce it: a job is this client's if its meta names this client
        or no client (enqueued without the producer); operators see every job. (Anyone with raw Redis
        access can read every hash anyway: docs/security.md.)"""
        owner = info.meta.get("client")
        return self.settings.operator or owner is None or owner == self.settings.client

    def _read(self, job_id: str) -> JobInfo:
        try:
            return self._status(job_id)
        except (JobNotFound, ServiceUnavailable, redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:  # (the request is deserialized lazily, after the fetch)
            raise JobUnreadable(job_id, exc) from None

    def _status(self, job_id: str) -> JobInfo:
        job = self.job(job_id)
        with _unavailable_on_error():
            rq_status = job.get_status(refresh=False)
            rq_value = rq_status.value if rq_status is not None else None
            meta = dict(job.meta or {})
            state = derive_state(rq_value, meta).value
            result = meta.get("result")
            if result is None and rq_value == "finished":
                with contextlib.suppress(Exception):
                    result = job.return_value()
                if state not in _TERMINAL and isinstance(result, dict) and _looks_uploaded(result):
                    state = JobState.UPLOADED.value
            error = meta.get("error")
            if error is None and state == JobState.FAILED.value:
                error = {"reason": None, "message": _last_line(job.exc_info) or "failed (no details recorded)"}
            request = job.args[0] if job.args and isinstance(job.args[0], dict) else None
            submitted = _utc(meta.get("submitted_at")) or job.created_at or job.enqueued_at
            requeued = job.enqueued_at if job.enqueued_at and submitted and job.enqueued_at > submitted else None
            ended = _utc(meta.get("ended_at")) if state in _TERMINAL else None
            return JobInfo(
                job_id=job.id,
                state=str(state),
                rq_status=rq_value,
                queue=job.origin,
                meta=meta,
                result=result if isinstance(result, dict) else None,
                error=error,
                request=request,
                enqueued_at=submitted,
                started_at=job.started_at,
                ended_at=ended or (job.ended_at if state in _TERMINAL else None),
                requeued_at=requeued,
            )

    def list_jobs(self, queues: list[str], limit: int) -> dict[str, list[JobInfo]]:
        """Up to `limit` jobs per section ("waiting", "running", "recently ended", newest first) of `queues`:
        this client's and unowned ones (every client's for an operator)."""
        sections: dict[str, list[JobInfo]] = {"waiting": [], "running": [], "recently ended": []}
        with _unavailable_on_error():
            for name in queues:
                q = self.queue(name)
                ids = {
                    "waiting": q.get_job_ids(0, limit - 1),
                    # cleanup=False: reading must never trigger RQ's registry maintenance (rq#2135)
                    "running": q.started_job_registry.get_job_ids(0, limit - 1, cleanup=False),
                    "recently ended": [
                        *q.finished_job_registry.get_job_ids(-limit, -1, cleanup=False),
                        *q.failed_job_registry.get_job_ids(-limit, -1, cleanup=False),
                        *q.canceled_job_registry.get_job_ids(-limit, -1, cleanup=False),
                    ],
                }
                for section, job_ids in ids.items():
                    for job_id in dict.fromkeys(job_ids):
                        try:
                            info = self._read(job_id)
                            if self._visible(info):
                                sections[section].append(info)
                        except JobUnreadable as exc:  # a note, never a crash of everyone's `ls`
                            sections[section].append(_unreadable_info(job_id, name, exc))
                        except JobNotFound:
                            continue
        ended = sections["recently ended"]
        ended.sort(key=lambda i: i.ended_at.timestamp() if i.ended_at else 0.0, reverse=True)
        return {section: rows[:limit] for section, rows in sections.items()}

    def peek_states(self, job_ids: list[str]) -> dict[str, str | None]:
        """The service state of many jobs in one round trip (None: no such job). Cheap enough to poll."""
        if not job_ids:
            return {}
        with _unavailable_on_error():
            pipe = self.connection.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hmget(Job.key_for(job_id), "status", "meta")
            rows = pipe.execute()
        states: dict[str, str | None] = {}
        for job_id, (raw_status, raw_meta) in zip(job_ids, rows, strict=True):
            if raw_status is None and raw_meta is None:
                states[job_id] = None
                continue
            meta: dict[str, Any] = {}
            if raw_meta:
                with contextlib.suppress(ValueError, TypeError):
                    loaded = JSONSerializer.loads(raw_meta)
                    meta = loaded if isinstance(loaded, dict) else {}
            states[job_id] = derive_state(raw_status.decode() if raw_status else None, meta).value
        return states

    # ---- events ------------------------------------------------------------------------------------
    def follow(
        self,
        job_id: str,
        *,
        after: str = "0-0",
        block_ms: int = 1000,
        reconnect_window_s: float = 60.0,
        on_reconnect: Callable[[Exception, float], None] | None = None,
        deadline: float | None = None,
    ) -> Iterator[JobEvent]:
        """Yield the job's events from `after` on, blocking for new ones, until the job ends.

        Reads with XREAD BLOCK and remembers the last entry id, so a lost connection resumes exactly
        where it stopped (no event twice, none skipped). Connection errors are retried with back-off for
        up to `reconnect_window_s` (`on_reconnect(error, retry_in_s)` is told each time), then raise
        ServiceUnavailable. Ends after the terminal `state` event, or, if the stream has no such event
        (expired, or the job ended without a worker), once the job's status is terminal and the stream is
        drained. `deadline` (time.monotonic) makes it return early; the caller checks the status.
        """
        key = events_key(job_id)
        last = after
        down_since: float | None = None
        backoff = 0.1
        self.status(job_id)  # JobNotFound (also for another client's job) before the first block
        reader = redis.Redis.from_url(
            self.settings.redis_url, socket_connect_timeout=5, socket_timeout=block_ms / 1000 + 10
        )
        try:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                try:
                    response = reader.xread({key: last}, count=200, block=block_ms)
                    idle = not response
                    for _stream, entries in response or []:
                        for entry_id, fields in entries:
                            event = _decode_entry(entry_id, fields)
                            last = event.id
                            yield event
                            if event.terminal_state:
                                return
                    if idle and self.status(job_id).terminal:
                        # One more non-blocking read: the terminal event may have landed just now.
                        tail = reader.xread({key: last}, count=200)
                        for _stream, entries in tail or []:
                            for entry_id, fields in entries:
                                event = _decode_entry(entry_id, fields)
                                last = event.id
                                yield event
                        return
                    down_since, backoff = None, 0.1
                except (redis.ConnectionError, redis.TimeoutError, ServiceUnavailable) as exc:
                    now = time.monotonic()
                    down_since = down_since or now
                    if now - down_since > reconnect_window_s:
                        raise ServiceUnavailable(
                            f"lost Redis at {safe_redis_url(self.settings.redis_url)} for more than "
                            f"{reconnect_window_s:.0f}s: {exc}"
                        ) from None
                    if on_reconnect is not None:
                        on_reconnect(exc, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            reader.close()

    def events(self, job_id: str, *, after: str = "0-0", count: int = 1000) -> list[JobEvent]:
        """The events recorded so far (no blocking)."""
        with _unavailable_on_error():
            entries = self.connection.xrange(
                events_key(job_id), min=f"({after}" if after != "0-0" else "-", count=count
            )
        return [_decode_entry(entry_id, fields) for entry_id, fields in entries]

    def wait(self, job_id: str, *, timeout: float | None = None, poll_s: float = 0.5) -> JobInfo:
        """Poll until the job is terminal (or `timeout` passes); returns the last status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.status(job_id)
            if info.terminal or (deadline is not None and time.monotonic() >= deadline):
                return info
            time.sleep(poll_s)

    # ---- cancel ------------------------------------------------------------------------------------
    def cancel(self, job_id: str) -> str:
        """Cancel a job (`worker.control.cancel_job`). Returns what happened: "cancelled" (it was waiting
        and will never run), "stop_requested" (it is running; the worker stops it cooperatively and keeps
        its fleet), or "already_<state>" when it had ended."""
        self.status(job_id)  # JobNotFound for another client's job (unless an operator)
        with _unavailable_on_error():
            try:
                return cancel_job(self.connection, job_id, failure_ttl=self.settings.failure_ttl)
            except NoSuchJobError:
                raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)") from None

    # ---- fetch -------------------------------------------------------------------------------------
    def fetch(self, job_id: str, dest: Path, *, chunk: int = 1 << 20) -> FetchResult:
        """Download the job's video to `dest` and verify its sha256 (written to a temporary file next to
        `dest`, renamed only after the hash matched)."""
        info = self.status(job_id)
        if info.state != JobState.UPLOADED.value or not info.result:
            raise JobNotReady(job_id, info.state)
        result = info.result
        expected = str(result.get("sha256") or "")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with partial.open("wb") as out:
                source, stream = self._open_object(result)
                with contextlib.closing(stream):
                    while True:
                        block = stream.read(chunk)
                        if not block:
                            break
                        out.write(block)
                        digest.update(block)
                        size += len(block)
            actual = digest.hexdigest()
            if expected and actual != expected:
                raise IntegrityError(
                    f"sha256 mismatch for job {job_id}: expected {expected}, got {actual} ({size} bytes); "
                    f"nothing written to {dest}"
                )
            if not expected:
                raise IntegrityError(f"job {job_id}'s result records no sha256; refusing an unverified file")
            os.replace(partial, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return FetchResult(path=dest, size=size, sha256=actual, source=source)

    def _open_object(self, result: dict[str, Any]) -> tuple[str, Any]:
        """An open binary stream of the result's object: S3 with credentials if configured, else the
        presigned URL, else a local path (the worker's local storage backend)."""
        bucket, key = result.get("bucket"), result.get("key")
        s = self.settings
        if bucket and key and s.has_s3_credentials:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError

            client = boto3.client(
                "s3",
                endpoint_url=s.s3_endpoint_url,
                region_name=s.s3_region,
                aws_access_key_id=s.s3_access_key_id.get_secret_value() if s.s3_access_key_id else None,
                aws_secret_access_key=s.s3_secret_access_key.get_secret_value() if s.s3_secret_access_key else None,
                config=Config(
                    signature_version="s3v4",
                    s3={"addressing_style": "path"},
                    retries={"mode": "standard", "max_attempts": 5},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                ),
            )
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
            except (BotoCoreError, ClientError) as exc:
                raise ServiceUnavailable(f"cannot read s3://{bucket}/{key}: {exc}") from None
            return f"s3://{bucket}/{key}", body
        url = result.get("url") or result.get("presigned_url")
        if not url and result.get("path"):
            url = Path(str(result["path"])).absolute().as_uri()
        if url:
            url = str(url)
            local = self._check_fetch_url(url)
            try:
                if local is not None:
                    return url, local.open("rb")
                return url.split("?", 1)[0], _NO_REDIRECTS.open(url, timeout=60)
            except (urllib.error.URLError, OSError) as exc:
                raise ServiceUnavailable(f"cannot download {url.split('?', 1)[0]}: {exc}") from None
        raise ServiceUnavailable("the job result names no reachable object (no S3 credentials and no URL)")

    def _check_fetch_url(self, url: str) -> Path | None:
        """A URL from job meta (anyone with Redis access can write it) is fetched only over http(s) from the
        configured endpoint, or as a file under `local_storage_dir` (the worker's local backend on this
        machine): `file://` URLs read any local file before, any other host made the producer a proxy.
        Returns the local file for a `file://` URL, None for an http(s) one; raises IntegrityError."""
        parts = urllib.parse.urlsplit(url)
        s = self.settings
        if parts.scheme == "file" and s.local_storage_dir is not None and parts.netloc in ("", "localhost"):
            path = Path(urllib.request.url2pathname(parts.path)).resolve()
            if path.is_relative_to(Path(s.local_storage_dir).resolve()):
                return path
        allowed = {_origin(e) for e in (s.s3_public_endpoint_url, s.s3_endpoint_url) if e}
        if parts.scheme in ("http", "https") and parts.hostname:
            if _origin(url) in allowed or (not allowed and parts.hostname.endswith(".amazonaws.com")):
                return None
        where = ", ".join(sorted(allowed)) or "AWS S3 (*.amazonaws.com)"
        if s.local_storage_dir is not None:
            where += f", or files under {s.local_storage_dir}"
        raise IntegrityError(f"refusing to fetch {url.split('?', 1)[0][:200]!r}: only http(s) from {where} "
                             "(LTX_S3_PUBLIC_ENDPOINT_URL / LTX_S3_ENDPOINT_URL / LTX_LOCAL_STORAGE_DIR)")  # fmt: skip

    # ---- stats -------------------------------------------------------------------------------------
    def stats(self, *, queues: list[str] | None = None, failures: int = 5) -> Stats:
        names = list(dict.fromkeys(queues or self.settings.queues))
        with _unavailable_on_error():
            qstats = []
            failed_ids: list[tuple[str, str]] = []
            for name in names:
                q = self.queue(name)
                # cleanup=False: reading must never trigger RQ's registry maintenance (rq#2135).
                qstats.append(
                    QueueStats(
                        name=name,
                        queued=q.count,
                        started=q.started_job_registry.get_job_count(cleanup=False),
                        finished=q.finished_job_registry.get_job_count(cleanup=False),
                        failed=q.failed_job_registry.get_job_count(cleanup=False),
                        canceled=q.canceled_job_registry.get_job_count(cleanup=False),
                        deferred=q.deferred_job_registry.get_job_count(cleanup=False),
                        scheduled=q.scheduled_job_registry.get_job_count(cleanup=False),
                    )
                )
                registry = FailedJobRegistry(name, connection=self.connection, serializer=JSONSerializer)
                # Newest last in the registry (scored by expiry); take the tail.
                for job_id in registry.get_job_ids(-failures, -1, cleanup=False):
                    failed_ids.append((name, job_id))
            workers = [self._worker_info(w) for w in Worker.all(connection=self.connection)]
            workers = [w for w in workers if not names or set(w.queues) & set(names)]
            recent = []
            for name, job_id in failed_ids:
                try:
                    info = self._read(job_id)
                    if not self._visible(info):
                        continue
                except JobUnreadable as exc:
                    recent.append(FailureInfo(job_id=job_id, queue=name, reason="unreadable", message=str(exc),
                                              ended_at=None))  # fmt: skip
                    continue
                except JobNotFound:
                    continue
                error = info.error or {}
                recent.append(
                    FailureInfo(
                        job_id=job_id,
                        queue=name,
                        reason=error.get("reason"),
                        message=str(error.get("message") or ""),
                        ended_at=info.ended_at,
                    )
                )
            recent.sort(key=lambda f: f.ended_at.timestamp() if f.ended_at else 0.0, reverse=True)
            return Stats(
                queues=qstats,
                workers=sorted(workers, key=lambda w: w.name),
                failures=recent[:failures],
                max_queue_depth=self.settings.max_queue_depth,
                client=self.settings.client,
                client_quota=self.settings.client_quota,
                client_unfinished=self._client_unfinished(self.settings.client),
            )

    def _worker_info(self, worker: Worker) -> WorkerInfo:
        health = None
        raw = self.connection.get(worker_health_key(worker.name))
        if raw:
            with contextlib.suppress(ValueError):
                health = json.loads(raw)
        fleet = health.get("fleet") if isinstance(health, dict) else None
        fleet_state = fleet.get("state") if isinstance(fleet, dict) else (fleet if isinstance(fleet, str) else None)
        group = None
        if isinstance(health, dict):
            group = health.get("group") or (fleet.get("group") if isinstance(fleet, dict) else None)
        return WorkerInfo(
            name=worker.name,
            state=str(worker.get_state()),
            queues=worker.queue_names(),
            current_job=worker.get_current_job_id(),
            group=str(group) if group is not None else None,
            fleet_state=str(fleet_state) if fleet_state is not None else None,
            last_heartbeat=worker.last_heartbeat,
            health=health if isinstance(health, dict) else None,
        )

    def _client_unfinished(self, client: str) -> int:
        live = 0
        for member in self.connection.zrange(client_key(client), 0, -1):
            status = self.connection.hget(Job.key_for(member.decode()), "status")
            if status is not None and status.decode() not in TERMINAL_STATUSES:
                live += 1
        return live


# ==== helpers ===========================================================================================


def _decode_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> JobEvent:
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


def _unreadable_info(job_id: str, queue: str, exc: JobUnreadable) -> JobInfo:
    return JobInfo(job_id=job_id, state=UNREADABLE, rq_status=None, queue=queue, meta={}, result=None,
                   error={"reason": UNREADABLE, "message": str(exc)}, request=None, enqueued_at=None,
                   started_at=None, ended_at=None)  # fmt: skip


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A presigned GET never redirects; following one would leave the checked endpoint."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl[:200]} refused", headers, fp)


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


def _utc(ts: Any) -> datetime | None:
    """A wall-clock timestamp (seconds) from the meta summary as an aware datetime."""
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        return None
    return datetime.fromtimestamp(ts, tz=UTC)


def _looks_uploaded(result: dict[str, Any]) -> bool:
    return bool(result.get("sha256")) and bool(result.get("key") or result.get("url") or result.get("path"))


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


@contextlib.contextmanager
def _unavailable_on_error() -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ServiceUnavailable(f"cannot reach Redis: {exc}") from None
