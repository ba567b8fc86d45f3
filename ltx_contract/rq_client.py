"""What a client does with RQ beyond `Job.fetch` and `Queue.create_job`: load a job hash within bounds
(`BoundedJob`), enqueue the way a tenant's Redis user may (`enqueue_unregistered`) and list the live workers
without writing (`live_workers`).

Anyone with Redis access writes job hashes, and a client reads them (`producer status`, `ls`, `fetch`), so a
client loads them as the worker does, within bounds:
- a hash bigger in Redis than a job of this service can be (`max_hash_bytes()`: twice the request and meta
  bounds plus slack) is never read at all: `MEMORY USAGE` first, then `OversizedJob` (a tenant who writes
  90 MB into her own job hash spends the service's memory, and every read of it would copy the 90 MB again);
- `data` is decompressed with a bound (`max_data_bytes`: the request; a 1.4 MB zlib bomb took a process to
  3.3 GB): data over it is replaced by a placeholder call that never runs; a meta over `max_meta_bytes` is
  replaced by an empty one; each is recorded as a refusal;
- the fields this service never writes and RQ would act on (callbacks, repeats, dependencies, webhooks:
  `REFUSED_HASH_FIELDS`) are dropped on load, so RQ never acts on them, and recorded as a refusal;
- a meta field that is not JSON is kept as text (`{"unserialized": "..."}`).
A client shows the job without the refusals; the worker's job class (`worker.rq.loop.job_class.RenderJob`)
refuses to run a job that has any, and repairs what RQ cannot load.

Of RQ this uses the client API (jobs, queues, the worker list) and one private method, `Queue._enqueue_job`:
a tenant's enqueue is RQ's `enqueue_job` without its `SADD rq:queues`, which RQ does not offer otherwise.
`tests/test_worker_rqcompat.py` checks that method's signature against the installed RQ (pinned to 2.12), and
no other module of the contract touches RQ's private state; everything else RQ keeps private is the worker's
(the worker's RQ wing, `worker.rq`).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from rq import worker_registration
from rq.job import Job
from rq.queue import Queue
from rq.utils import decode_redis_hash

from ltx_contract.errors import ContractError
from ltx_contract.keys import RENDER_FUNC

__all__ = ["REFUSED_HASH_FIELDS", "BoundedJob", "OversizedJob", "enqueue_unregistered", "live_workers"]

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


class OversizedJob(ContractError, RuntimeError):
    """The job hash takes more memory than any job of this service: refused without reading it (raised by
    `BoundedJob.refresh`; the worker records it: `worker.rq.loop.unstarted.drop_oversized`)."""

    def __init__(self, job_id: str, size: int, cap: int) -> None:
        super().__init__(f"the job hash takes {size} bytes in Redis, over {cap}: refused without reading it")
        self.job_id = job_id


class BoundedJob(Job):
    """A job loaded within bounds; see the module docstring."""

    max_data_bytes: int = 1 << 20  #: decompressed `data` (the call and its request) accepted
    max_meta_bytes: int = 64 << 10  #: serialized meta accepted

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

    def restore(self, raw_data: Any) -> Any:
        obj = decode_redis_hash(raw_data)
        refusals: list[str] = []
        present = [name for name in REFUSED_HASH_FIELDS if obj.get(name) not in (None, b"", b"[]")]
        if present:
            refusals.append(f"the job hash carries {', '.join(present)}, which this service never sets")
        for name in REFUSED_HASH_FIELDS:
            obj.pop(name, None)
        refusals += self._hash_repairs(obj)
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

    def _hash_repairs(self, obj: dict[str, Any]) -> list[str]:
        """Repair the decoded hash `obj` in place before it is loaded; the refusals that says. None here: a
        client shows what it cannot load as unreadable (the worker's class repairs: `RenderJob`)."""
        return []

    def _data_refusal(self, data: bytes) -> str | None:
        """Why `data` may not even be read, or None: over `max_data_bytes` once inflated (counted without
        inflating more)."""
        if _decompressed_size(data, self.max_data_bytes) > self.max_data_bytes:
            return f"the job's data exceeds {self.max_data_bytes} bytes"
        return None


def _decompressed_size(data: bytes, limit: int) -> int:
    """How many bytes `data` holds once decompressed, counting at most `limit + 1` (RQ stores it with zlib;
    data that is not zlib is taken as is, as RQ does)."""
    try:
        out = zlib.decompressobj().decompress(data, limit + 1)
    except zlib.error:
        return len(data)
    return len(out)


def enqueue_unregistered(queue: Queue, job: Job, *, pipeline: Any, at_front: bool = False) -> Job:
    """RQ's `Queue.enqueue_job` for a job without dependencies, minus its `SADD rq:queues`: a tenant's Redis
    user may not add names to that set (it could add them without bound); workers register the queues they
    serve (`worker.rq.loop.registries.register_queues`). The job hash and the push are RQ's own."""
    job.origin = queue.name
    return queue._enqueue_job(job, pipeline=pipeline, at_front=at_front)


def live_workers(connection: Any, *, queue: Queue | None = None, serializer: Any = None) -> list[Any]:
    """RQ's `Worker.all()` without its writes: RQ removes a dead worker's entry from `rq:workers` with SREM
    while listing, which a tenant's Redis user may not do (every `producer submit` and `stats` crashed after
    a worker died). Entries whose key is gone are skipped; the workers' own cleanup removes them."""
    from rq.worker import Worker

    keys = [
        k.decode() if isinstance(k, bytes) else k
        for k in worker_registration.get_keys(queue=queue, connection=connection)
    ]
    prefix = Worker.redis_worker_namespace_prefix
    out = []
    for key in sorted(keys):
        if not key.startswith(prefix) or not connection.exists(key):
            continue
        worker = Worker([], key[len(prefix) :], connection=connection, prepare_for_work=False, serializer=serializer)
        worker.refresh()  # (reads the hash; a key that vanished meanwhile leaves the defaults)
        out.append(worker)
    return out
