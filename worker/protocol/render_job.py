"""`RenderJob`: the RQ job class of render workers, hardened against what anyone with Redis access can push.

A plain RQ job executes *any* importable function named in its hash (a hand-written `rq:job:<id>` naming
`os.makedirs` runs it), calls any module attribute named as a success/failure/stopped callback, re-runs as
often as its `repeats_left` says, posts to its webhooks, decompresses its `data` without a bound (a 1.4 MB
zlib bomb takes a worker to 3.3 GB), and rewrites a meta of any size on every event; a hash RQ cannot parse
(`created_at: "yesterday"`) or whose meta is not JSON ends the worker process and its warm fleet. This class:

- executes only `worker.protocol.keys.RENDER_FUNC` (checked in `check_runnable`, RQ's last step before the
  call: `worker.protocol.rq_compat.GuardedJob`); any other function, a job id `worker.protocol.keys.check_job_id`
  refuses, an owner (meta `client`) that `worker.protocol.keys.check_client_name` refuses, or a hash carrying
  fields this service never writes (callbacks, repeats, dependencies, webhooks) fails the job with
  `RefusedJob` (recorded as `invalid_request`); those fields are dropped on load, so RQ never acts on
  them (RQ calls a failure callback even for a refused job);
- with tenant job ids on (`LTX_TENANT_IDS`: tenants' Redis users can write only `rq:job:<tenant>-*`), a job
  whose meta `client` is not its id's tenant prefix is refused the same way (`check_job_owner`), so a
  tenant cannot submit under another tenant's name (their quota, their `ls`);
- `data` is decompressed with a bound (`max_data_bytes`: the request) and must read as a call (RQ's
  `[function, instance, args, kwargs]`); a meta over `max_meta_bytes` is replaced by an empty one; both are
  refused the same way (data that was not a call failed as `internal`: RQ's `DeserializationError`);
- a field RQ parses on load (its dates, TTLs and timeouts, status, names) holding a value RQ's own parse
  refuses (`created_at: "yesterday"`) is dropped and the job refused the same way: the hash used to be
  unreadable, failed in RQ by `fail_unreadable` while its recorded state stayed `queued` (in a worker's
  class only, `repairs`: to a client such a hash stays unreadable);
- a hash bigger in Redis than a job of this service can be (`max_hash_bytes()`: twice the request and
  meta bounds plus slack) is never read at all: `MEMORY USAGE` first, then `rq_compat.OversizedJob`, and the
  worker deletes it and records the failure (`rq_compat.drop_oversized`): a tenant who writes 90 MB into her own
  job hash spends the service's memory, and every read of it would copy the 90 MB again;
- a meta field that is not JSON is kept as text (`{"unserialized": "..."}`) so the job can be saved and failed;
- `worker.protocol.rq_compat.fail_unreadable()` records a job that still cannot be loaded as failed (hash status,
  failed registry, expiry), so a dequeue never kills the worker and the job never sits in `queued` forever.

The limits come from the worker's settings through `RenderJob.with_limits()`, a subclass per worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from typing import Any

import redis
from rq.job import JobStatus
from rq.utils import decode_redis_hash, parse_timeout, str_to_date

from worker.errors import WorkerError
from worker.protocol.keys import RENDER_FUNC, check_job_id, job_owner, job_tenant
from worker.protocol.rq_compat import GuardedJob, OversizedJob

__all__ = ["REFUSED_HASH_FIELDS", "RefusedJob", "RenderJob", "check_job_owner"]

log = logging.getLogger("worker.rq")

#: Job-hash fields the producer never writes and RQ would act on: refused, and dropped before RQ sees them.
REFUSED_HASH_FIELDS = (
    "success_callback_name",
    "failure_callback_name",
    "stopped_callback_name",
    "repeats_left",
    "repeat_intervals",
    "dependency_ids",
    "dependency_id",
    "webhooks",
)
_CALL_PLACEHOLDER = zlib.compress(json.dumps([RENDER_FUNC, None, [], {}]).encode())  # never run: refused


def _exc_text(value: bytes) -> str:
    try:
        value = zlib.decompress(value)
    except zlib.error:
        pass  # (RQ too: stored uncompressed)
    return value.decode("utf-8")


#: Job-hash fields RQ parses in `Job.restore`, each with the parse RQ applies to it (a value it refuses made
#: the whole hash unreadable). RQ parses those in `_PARSED_WHEN_EMPTY` even when empty (and fails: never
#: written so; an empty value carries nothing, so it is dropped without a refusal).
_DATES = "created_at enqueued_at started_at ended_at last_heartbeat".split()
_INTS = (
    "result_ttl failure_ttl ttl number_of_retries retries_left enqueue_at_front enqueue_at_front_on_retry "
    "allow_dependency_failures success_callback_timeout failure_callback_timeout stopped_callback_timeout"
).split()
_TEXTS = "origin worker_name description group_id".split()
_RQ_PARSED: dict[str, Any] = {
    **dict.fromkeys(_DATES, str_to_date),
    **dict.fromkeys(_INTS, int),
    **dict.fromkeys(_TEXTS, lambda v: v.decode("utf-8")),
    "timeout": parse_timeout,
    "status": lambda v: JobStatus(v.decode("utf-8")),
    "retry_intervals": lambda v: json.loads(v.decode()),
    "exc_info": _exc_text,
}
_PARSED_WHEN_EMPTY = frozenset(
    {"enqueue_at_front", "success_callback_timeout", "failure_callback_timeout", "stopped_callback_timeout"}
)


class RefusedJob(WorkerError, RuntimeError):
    """The job hash is not one this service runs (another function, a bad id, refused fields): never executed."""


class RenderJob(GuardedJob):
    """See the module docstring."""

    max_data_bytes: int = 1 << 20  #: decompressed `data` (the call and its request) accepted
    max_meta_bytes: int = 64 << 10  #: serialized meta accepted
    tenant_ids: bool = False  #: job ids are `<client>-<id>`: the owner must match (`check_job_owner`)
    #: Refuse what RQ cannot load (a field its parse refuses, data that is no call) instead of failing the load:
    #: a worker's class (`with_limits`), which ends the job with a record. A client reading jobs (the producer)
    #: keeps them unreadable: it shows nothing a dropped field or a placeholder call would make up.
    repairs: bool = False

    @classmethod
    def max_hash_bytes(cls) -> int:
        """The most memory a job hash of this service takes: its request and meta at their bounds, twice
        (Redis's own overhead; a hash re-saved mid-update), plus RQ's fields and a failure record."""
        return 2 * (cls.max_data_bytes + cls.max_meta_bytes) + (256 << 10)

    def refresh(self) -> None:
        size = self.connection.memory_usage(self.key, samples=0)
        if size is not None and size > self.max_hash_bytes():
            raise OversizedJob(self.id, int(size), self.max_hash_bytes())
        super().refresh()

    @classmethod
    def with_limits(cls, *, max_data_bytes: int, max_meta_bytes: int, tenant_ids: bool = False) -> type[RenderJob]:
        """A subclass with these limits (one per worker, from its settings)."""
        limits = {"max_data_bytes": max_data_bytes, "max_meta_bytes": max_meta_bytes, "tenant_ids": tenant_ids}
        return type("RenderJob", (cls,), {**limits, "repairs": True})

    def restore(self, raw_data: Any) -> Any:
        obj = decode_redis_hash(raw_data)
        refusals: list[str] = []
        present = [name for name in REFUSED_HASH_FIELDS if obj.get(name) not in (None, b"", b"[]")]
        if present:
            refusals.append(f"the job hash carries {', '.join(present)}, which this service never sets")
        for name in REFUSED_HASH_FIELDS:
            obj.pop(name, None)
        if self.repairs and (dropped := _drop_unparseable(obj)):
            refusals += [f"the job hash's {name} is not a value RQ writes ({value[:40]!r})" for name, value in dropped]
            # (RQ re-saves only the fields it holds: the refused job's hash must read back, for clients too)
            with contextlib.suppress(redis.RedisError):
                self.connection.hdel(self.key, *(name for name, _ in dropped))
        data = obj.get("data")
        if isinstance(data, bytes) and (refusal := self._data_refusal(data)) is not None:
            refusals.append(refusal)
            obj["data"] = _CALL_PLACEHOLDER
        meta = obj.get("meta")
        if isinstance(meta, bytes) and len(meta) > self.max_meta_bytes:
            refusals.append(f"the job's meta has {len(meta)} bytes, over {self.max_meta_bytes}")
            obj["meta"] = b"{}"
        out = super().restore(obj)
        meta_now = self.meta
        if isinstance(meta_now, dict) and isinstance(meta_now.get("unserialized"), bytes):
            self.meta = {"unserialized": meta_now["unserialized"].decode("utf-8", "replace")}
        # (kept across refreshes: a refresh after RQ re-saved the cleaned hash must not forget them)
        self._refusals = list(dict.fromkeys([*getattr(self, "_refusals", []), *refusals]))
        return out

    def _data_refusal(self, data: bytes) -> str | None:
        """Why `data` is not a call this worker may even read, or None: over `max_data_bytes` once inflated
        (counted without inflating more), or not what RQ's `_deserialize_data` unpacks."""
        if _decompressed_size(data, self.max_data_bytes) > self.max_data_bytes:
            return f"the job's data exceeds {self.max_data_bytes} bytes"
        if not self.repairs:
            return None
        try:
            call = zlib.decompress(data)  # (at most max_data_bytes: counted above)
        except zlib.error:
            call = data  # (RQ takes data that is not zlib as is)
        try:
            _func, _instance, _args, _kwargs = self.serializer.loads(call)
        except Exception:
            return "the job's data is not a call ([function, instance, args, kwargs] as JSON, zlib-compressed)"
        return None

    def check_runnable(self) -> None:
        """Refuse (`RefusedJob`) what the module docstring lists, before RQ calls the job function."""
        if self.func_name != RENDER_FUNC:
            raise RefusedJob(f"this worker only runs {RENDER_FUNC}; refusing to run {self.func_name!r}")
        try:
            check_job_id(self.id)  # (RQ checks only the characters; a long id broke the spool)
        except ValueError as exc:
            raise RefusedJob(str(exc)) from None
        try:
            job_owner(self.meta)  # (quotas count against it; a name RQ keys and operators' tables cannot hold)
        except ValueError as exc:
            raise RefusedJob(f"owner: {exc}") from None
        if getattr(self, "_refusals", None):
            raise RefusedJob("; ".join(self._refusals))
        if self.tenant_ids:
            check_job_owner(self.id, self.meta)


def check_job_owner(job_id: str, meta: Any) -> None:
    """With tenant job ids, `job_id`'s tenant prefix must be the client recorded in its meta; else
    `RefusedJob`. A tenant's Redis user can create only its own ids, but writes the meta itself."""
    owner = meta.get("client") if isinstance(meta, dict) else None
    tenant = job_tenant(job_id)
    if tenant is None or owner != tenant:
        raise RefusedJob(f"job {job_id[:60]!r} is not a tenant job of its recorded client {str(owner)[:40]!r} "
                         "(tenant ids: the id must be '<client>-<id>')")  # fmt: skip


def _drop_unparseable(obj: dict[str, Any]) -> list[tuple[str, bytes]]:
    """Drop from a job hash (decoded keys) each field whose value RQ's own parse refuses; (name, value) each."""
    dropped = []
    for name, parse in _RQ_PARSED.items():
        value = obj.get(name)
        if value == b"" and name in _PARSED_WHEN_EMPTY:
            obj.pop(name)
        if not value:
            continue
        try:
            parse(value)
        except Exception:
            dropped.append((name, obj.pop(name)))
    return dropped


def _decompressed_size(data: bytes, limit: int) -> int:
    """How many bytes `data` holds once decompressed, counting at most `limit + 1` (RQ stores it with zlib;
    data that is not zlib is taken as is, as RQ does)."""
    try:
        out = zlib.decompressobj().decompress(data, limit + 1)
    except zlib.error:
        return len(data)
    return len(out)
