"""`RenderJob`: the RQ job class of render workers, hardened against what anyone with Redis access can push.

A plain RQ job executes *any* importable function named in its hash (a hand-written `rq:job:<id>` naming
`os.makedirs` runs it), calls any module attribute named as a success/failure/stopped callback, re-runs as
often as its `repeats_left` says, posts to its webhooks, decompresses its `data` without a bound (a 1.4 MB
zlib bomb takes a worker to 3.3 GB), and rewrites a meta of any size on every event; a hash RQ cannot parse
(`created_at: "yesterday"`) or whose meta is not JSON ends the worker process and its warm fleet. The load
within bounds is the contract's (`ltx_contract.rq_client.BoundedJob`, which clients use too: an oversized hash
is never read, `data` and meta are bounded, the fields RQ would act on are dropped, each recorded as a
refusal). On top of it this class:

- executes only `ltx_contract.keys.RENDER_FUNC` (checked in `check_runnable`, RQ's last step before the
  call: `GuardedJob`); any other function, a job id `ltx_contract.keys.check_job_id`
  refuses, an owner (meta `client`) that `ltx_contract.keys.check_client_name` refuses, or any refusal of the
  load (callbacks, repeats, dependencies, webhooks, data or meta over its bound) fails the job with
  `RefusedJob` (recorded as `invalid_request`; RQ calls a failure callback even for a refused job, so those
  fields are dropped on load);
- with tenant job ids on (`LTX_TENANT_IDS`: tenants' Redis users can write only `rq:job:<tenant>-*`), a job
  whose meta `client` is not its id's tenant prefix is refused the same way (`check_job_owner`), so a
  tenant cannot submit under another tenant's name (their quota, their `ls`);
- `data` must read as a call (RQ's `[function, instance, args, kwargs]`), or the job is refused the same way
  (data that was not a call failed as `internal`: RQ's `DeserializationError`);
- a field RQ parses on load (its dates, TTLs and timeouts, status, names) holding a value RQ's own parse
  refuses (`created_at: "yesterday"`) is dropped and the job refused the same way: the hash used to be
  unreadable, failed in RQ by `fail_unreadable` while its recorded state stayed `queued` (in a worker's
  class only, `repairs`: to a client such a hash stays unreadable);
- an oversized hash (`ltx_contract.rq_client.OversizedJob`) is deleted and its failure recorded
  (`worker.rq.loop.unstarted.drop_oversized`);
- `worker.rq.loop.unstarted.fail_unreadable()` records a job that still cannot be loaded as failed (hash status,
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
from rq.job import Job, JobStatus
from rq.utils import parse_timeout, str_to_date

from ltx_contract.keys import RENDER_FUNC, check_job_id, job_owner, job_tenant
from ltx_contract.rq_client import BoundedJob
from worker.errors import WorkerError

__all__ = ["GuardedJob", "RefusedJob", "RenderJob", "check_job_owner"]

log = logging.getLogger("worker.rq")


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


class GuardedJob(Job):
    """A `Job` that runs `check_runnable()` right before RQ calls its function, inside RQ's execution, so an
    exception there fails the job exactly as one raised by the function would. RQ has no public hook at
    that point: `Job.perform()` calls the private `_execute()`, which is overridden here and nowhere else."""

    def check_runnable(self) -> None:
        """Raise to fail the job without calling its function; the default lets every job run."""

    def _execute(self) -> Any:
        self.check_runnable()
        return super()._execute()


class RefusedJob(WorkerError, RuntimeError):
    """The job hash is not one this service runs (another function, a bad id, refused fields): never executed."""


class RenderJob(BoundedJob, GuardedJob):
    """See the module docstring."""

    tenant_ids: bool = False  #: job ids are `<client>-<id>`: the owner must match (`check_job_owner`)
    #: Refuse what RQ cannot load (a field its parse refuses, data that is no call) instead of failing the load:
    #: a worker's class (`with_limits`), which ends the job with a record. A client reading jobs (the producer)
    #: keeps them unreadable: it shows nothing a dropped field or a placeholder call would make up.
    repairs: bool = False

    @classmethod
    def with_limits(cls, *, max_data_bytes: int, max_meta_bytes: int, tenant_ids: bool = False) -> type[RenderJob]:
        """A subclass with these limits (one per worker, from its settings)."""
        limits = {"max_data_bytes": max_data_bytes, "max_meta_bytes": max_meta_bytes, "tenant_ids": tenant_ids}
        return type("RenderJob", (cls,), {**limits, "repairs": True})

    def _hash_repairs(self, obj: dict[str, Any]) -> list[str]:
        """With `repairs`, drop each field RQ's own parse refuses (from Redis too) and say so."""
        if not self.repairs or not (dropped := _drop_unparseable(obj)):
            return []
        # (RQ re-saves only the fields it holds: the refused job's hash must read back, for clients too)
        with contextlib.suppress(redis.RedisError):
            self.connection.hdel(self.key, *(name for name, _ in dropped))
        return [f"the job hash's {name} is not a value RQ writes ({value[:40]!r})" for name, value in dropped]

    def _data_refusal(self, data: bytes) -> str | None:
        """The bound's refusal (`BoundedJob`), else with `repairs` whether `data` is what RQ's
        `_deserialize_data` unpacks."""
        refusal = super()._data_refusal(data)
        if refusal is not None or not self.repairs:
            return refusal
        try:
            call = zlib.decompress(data)  # (at most max_data_bytes: counted by the bound)
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
        raise RefusedJob(
            f"job {job_id[:60]!r} is not a tenant job of its recorded client {str(owner)[:40]!r} "
            "(tenant ids: the id must be '<client>-<id>')"
        )


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
