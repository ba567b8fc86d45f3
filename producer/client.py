"""The producer's Python API: submit, status, follow events, cancel, fetch, stats. The CLI is built on it.

This module holds the client and its Redis queries; `producer.models` the views and errors it returns,
`producer.download` its `fetch` and `producer.stats` its `stats` (mixed in, one facade).

It talks to Redis (RQ with its JSON serializer: no pickle crosses Redis) and, for `fetch`, to S3 or a
presigned URL. It knows the worker only through `ltx_contract.schema` (the request model) and `ltx_contract.keys`
(Redis names, states, event types): both import neither torch nor ltx_mgpu, so this stays a light client.

Which state counts: the service state in the job's meta (`ltx_contract.states.JobState`) is authoritative, with
RQ's coarser status as a fallback when no worker ever wrote one (e.g. a job cancelled while queued, or a
worker that died before it started the job). A job is done when its state is terminal: `uploaded`
(the video is in storage), `failed` or `cancelled`; RQ's `finished` alone is not enough, because the
upload may still be running after the RQ job returned.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from ltx_contract.control import cancel_job
from ltx_contract.health import SnapshotError, read_health
from ltx_contract.keys import RENDER_FUNC, check_job_id, events_key, tenant_job_id, worker_health_key
from ltx_contract.limits import LimitViolation, RunnerLimits
from ltx_contract.redis_conn import connect
from ltx_contract.rq_client import BoundedJob, live_workers
from ltx_contract.schema import RenderRequest
from ltx_contract.shared_settings import safe_redis_url
from ltx_contract.states import JobState, derive_state
from producer.admission import AdmissionPolicy, check_client_name, enqueue_admitted
from producer.download import ObjectDownloads
from producer.models import (  # (the views and errors are re-exported: `from producer.client import JobInfo`)
    TERMINAL_VALUES,
    FetchRefused,
    FetchResult,
    IntegrityError,
    InvalidJobId,
    JobEvent,
    JobInfo,
    JobNotFound,
    JobNotReady,
    JobUnreadable,
    QueueStats,
    ServiceUnavailable,
    Stats,
    WorkerInfo,
    content_job_id,
    decode_event,
    last_line,
    looks_uploaded,
    redis_problem,
    requeued_at,
    unavailable_on_error,
    unreadable_info,
    utc_from,
)
from producer.settings import ProducerSettings
from producer.stats import StatsQueries

__all__ = [
    "FetchRefused",
    "FetchResult",
    "IntegrityError",
    "InvalidJobId",
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
# ==== the client ========================================================================================


class ProducerClient(ObjectDownloads, StatsQueries):
    """A connection to the render service. Cheap to create; thread-safe like redis-py itself."""

    def __init__(self, settings: ProducerSettings, *, connection: redis.Redis | None = None) -> None:
        self.settings = settings
        self.connection = connection or connect(
            settings, socket_connect_timeout=5, socket_timeout=30, health_check_interval=15
        )

    def close(self) -> None:
        self.connection.close()

    def check_connection(self) -> None:
        """Open a connection now (connect, TLS, AUTH, SELECT), so a wrong URL, password or database is one
        `ServiceUnavailable` before any command, not an error halfway through one. No command is sent: any
        ACL user passes."""
        pool, url = self.connection.connection_pool, self.settings.redis_url
        try:
            pool.release(pool.get_connection())
        except redis.RedisError as exc:  # (a refused handshake is a Redis problem, whatever its class)
            message, bad = redis_problem(exc, url) or (
                f"Redis at {safe_redis_url(url)} refused the connection: {' '.join(str(exc).split())[:300]}",
                True,
            )
            raise ServiceUnavailable(message, misconfigured=bad) from None

    def __enter__(self) -> ProducerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submit ------------------------------------------------------------------------------------
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
        quota used up), `JobExists` (a `job_id` that exists), `ServiceUnavailable`, ValueError (a
        `job_id` that `ltx_contract.keys.check_job_id` refuses).
        """
        if priority not in ("normal", "high"):
            raise ValueError(f"priority must be 'normal' or 'high', got {priority!r}")
        s = self.settings
        client = check_client_name(client or s.client)
        if s.tenant_ids:
            if client != s.client:
                raise ValueError(f"client {client!r}: a tenant (LTX_TENANT_IDS) submits only as itself ({s.client!r})")
            job_id = tenant_job_id(client, job_id or uuid.uuid4().hex)
        if job_id is not None:
            check_job_id(job_id)  # (the worker refuses it too; RQ checks only the characters)
        depth = s.max_queue_depth if max_queue_depth is None else max_queue_depth
        quota = s.client_quota if client_quota is None else client_quota
        policy = AdmissionPolicy(max_queue_depth=depth or None, client_quota=quota or None)
        q = self.queue(queue)
        meta = {"state": JobState.QUEUED.value, "client": client, "submitted_at": time.time(), **(extra_meta or {})}
        if len(json.dumps(meta)) > BoundedJob.max_meta_bytes:  # (the worker refuses it too, per its settings)
            raise ValueError(f"extra_meta: the job's meta would exceed {BoundedJob.max_meta_bytes} bytes")
        with unavailable_on_error(self.settings.redis_url):
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
            counted = list({c.name: c for c in (self.queue(name) for name in [*s.queues, q.name])}.values())
            return enqueue_admitted(
                q, job, policy=policy, counted_queues=counted, client=client, at_front=priority == "high"
            )

    def runner_limits(self, queue: str | None = None) -> list[tuple[str, RunnerLimits]]:
        """The request limits the live workers on `queue` publish (worker name, limits); see ltx_contract.limits."""
        out: list[tuple[str, RunnerLimits]] = []
        with unavailable_on_error(self.settings.redis_url):
            for worker in live_workers(self.connection, queue=self.queue(queue)):
                try:
                    health = read_health(self.connection.get(worker_health_key(worker.name)))
                except SnapshotError:
                    continue  # (`producer stats` names the worker and what is wrong with its snapshot)
                limits = health.runner_limits() if health is not None else None
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
    def own_job_id(self, job_id: str) -> str:
        """`job_id` as this client names it in Redis: with tenant ids on (`LTX_TENANT_IDS`), `<client>-<id>`
        (the prefix is added when missing, so `status 42` and `status alice-42` are the same job)."""
        own = tenant_job_id(self.settings.client, job_id) if self.settings.tenant_ids else job_id
        try:
            return check_job_id(own)
        except ValueError as exc:
            raise InvalidJobId(f"invalid {exc}") from None

    def job(self, job_id: str) -> Job:
        """The RQ job (loaded as the worker loads it: `BoundedJob` bounds what it decompresses)."""
        job_id = self.own_job_id(job_id)
        with unavailable_on_error(self.settings.redis_url):
            try:
                return BoundedJob.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
            except NoSuchJobError:
                raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)") from None
            except redis.RedisError as exc:
                if redis_problem(exc) is not None:
                    raise  # (unavailable_on_error: Redis cannot be used, whichever job this is)
                raise JobUnreadable(job_id, exc) from None  # (WRONGTYPE: a key of another type at this name)
            except Exception as exc:  # RQ's parse errors: DeserializationError, ValueError, TypeError, ...
                raise JobUnreadable(job_id, exc) from None

    def status(self, job_id: str) -> JobInfo:
        """The job's state and records. Raises JobNotFound (also for another client's job, unless this
        client is an operator), JobUnreadable (a hash that cannot be read), InvalidJobId."""
        self.own_job_id(job_id)  # (a malformed id is the caller's error; one listed from Redis is a note: _read)
        info = self._read(job_id)
        if not self._visible(info):
            raise JobNotFound(
                f"no job {job_id!r} of client {self.settings.client!r} (another client's job; "
                "operators, LTX_OPERATOR=true, see every job)"
            )
        return info

    def _may_read(self, job_id: str) -> bool:
        """Whether this client reads `job_id`'s hash at all when listing: a tenant (`LTX_TENANT_IDS`) only
        its own `<client>-*` ids, whose keys are the only job keys its Redis user may read."""
        return not self.settings.tenant_ids or self.settings.operator or job_id.startswith(f"{self.settings.client}-")

    def _visible(self, info: JobInfo) -> bool:
        """Tenancy, as far as a client can enforce it: a job is this client's if its meta names this client
        or no client (enqueued without the producer); operators see every job. (Without Redis ACL users,
        anyone with raw Redis access can read every hash anyway: docs/security.md.)"""
        owner = info.meta.get("client")
        return self.settings.operator or owner is None or owner == self.settings.client

    def _read(self, job_id: str) -> JobInfo:
        try:
            return self._status(job_id)
        except (JobNotFound, ServiceUnavailable):
            raise
        except Exception as exc:  # (the request is deserialized lazily, after the fetch)
            raise JobUnreadable(job_id, exc) from None

    def _status(self, job_id: str) -> JobInfo:
        job = self.job(job_id)
        with unavailable_on_error(self.settings.redis_url):
            rq_status = job.get_status(refresh=False)
            rq_value = rq_status.value if rq_status is not None else None
            meta = dict(job.meta or {})
            state = derive_state(rq_value, meta).value
            result = meta.get("result")
            if result is None and rq_value == "finished":
                with contextlib.suppress(Exception):
                    result = job.return_value()
                if state not in TERMINAL_VALUES and isinstance(result, dict) and looks_uploaded(result):
                    state = JobState.UPLOADED.value
            error = meta.get("error")
            if error is None and state == JobState.FAILED.value:
                error = {"reason": None, "message": last_line(job.exc_info) or "failed (no details recorded)"}
            request = job.args[0] if job.args and isinstance(job.args[0], dict) else None
            submitted = utc_from(meta.get("submitted_at")) or job.created_at or job.enqueued_at
            requeued = requeued_at(job.enqueued_at, job.started_at, meta)
            ended = utc_from(meta.get("ended_at")) if state in TERMINAL_VALUES else None
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
                ended_at=ended or (job.ended_at if state in TERMINAL_VALUES else None),
                requeued_at=requeued,
            )

    def list_jobs(self, queues: list[str], limit: int) -> dict[str, list[JobInfo]]:
        """Up to `limit` jobs per section ("waiting", "running", "recently ended", newest first) of `queues`:
        this client's and unowned ones (every client's for an operator)."""
        sections: dict[str, list[JobInfo]] = {"waiting": [], "running": [], "recently ended": []}
        with unavailable_on_error(self.settings.redis_url):
            for q in self.view_queues(queues):
                name = q.name
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
                        if not self._may_read(job_id):
                            continue
                        try:
                            info = self._read(job_id)
                            if self._visible(info):
                                sections[section].append(info)
                        except JobUnreadable as exc:  # a note, never a crash of everyone's `ls`
                            sections[section].append(unreadable_info(job_id, name, exc))
                        except JobNotFound:
                            continue
        ended = sections["recently ended"]
        ended.sort(key=lambda i: i.ended_at.timestamp() if i.ended_at else 0.0, reverse=True)
        return {section: rows[:limit] for section, rows in sections.items()}

    def peek_states(self, job_ids: list[str]) -> dict[str, str | None]:
        """The service state of many jobs in one round trip (None: no such job). Cheap enough to poll."""
        if not job_ids:
            return {}
        with unavailable_on_error(self.settings.redis_url):
            pipe = self.connection.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hmget(Job.key_for(self.own_job_id(job_id)), "status", "meta")
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
        key = events_key(self.own_job_id(job_id))
        last = after
        down_since: float | None = None
        backoff = 0.1
        self.status(job_id)  # JobNotFound (also for another client's job) before the first block
        reader = connect(self.settings, socket_connect_timeout=5, socket_timeout=block_ms / 1000 + 10)
        try:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                try:
                    with unavailable_on_error(self.settings.redis_url):
                        response = reader.xread({key: last}, count=200, block=block_ms)
                    idle = not response
                    for _stream, entries in response or []:
                        for entry_id, fields in entries:
                            event = decode_event(entry_id, fields)
                            last = event.id
                            yield event
                            if event.terminal_state:
                                return
                    if idle and self.status(job_id).terminal:
                        # One more non-blocking read: the terminal event may have landed just now.
                        with unavailable_on_error(self.settings.redis_url):
                            tail = reader.xread({key: last}, count=200)
                        for _stream, entries in tail or []:
                            for entry_id, fields in entries:
                                event = decode_event(entry_id, fields)
                                last = event.id
                                yield event
                        return
                    down_since, backoff = None, 0.1
                except (redis.ConnectionError, redis.TimeoutError, ServiceUnavailable) as exc:
                    if isinstance(exc, ServiceUnavailable) and exc.misconfigured:
                        raise  # (refused, not dropped: no reconnect will help)
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
        with unavailable_on_error(self.settings.redis_url):
            entries = self.connection.xrange(
                events_key(self.own_job_id(job_id)), min=f"({after}" if after != "0-0" else "-", count=count
            )
        return [decode_event(entry_id, fields) for entry_id, fields in entries]

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
        """Cancel a job (`ltx_contract.control.cancel_job`). Returns what happened: "cancelled" (it was waiting
        and will never run), "stop_requested" (it is running; the worker stops it cooperatively and keeps
        its fleet), or "already_<state>" when it had ended."""
        job_id = self.status(job_id).job_id  # JobNotFound for another client's job (unless an operator)
        with unavailable_on_error(self.settings.redis_url):
            try:
                return cancel_job(self.connection, job_id, failure_ttl=self.settings.failure_ttl)
            except NoSuchJobError:
                raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)") from None
