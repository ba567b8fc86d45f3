"""Tenant queues: what a tenant pushes lands where only its own jobs count, and no id runs unchecked.

Why: a tenant's Redis user can push any string onto a queue list it may write, and pushing is far cheaper
than anything done about it. Unless queues are per tenant and every dequeued id is checked, a few bogus ids
(or a tenant's own hashes naming another client as owner) make another tenant's jobs end `queue_full` and its
submits refused; a burst of them refuses every producer and holds the worker for as long as skipping them
takes; and a re-pushed failed id of another tenant renders that job again (RQ's dequeue does not check a
dequeued job's status).

The layout (`ltx_contract.keys`): with `LTX_TENANTS`, each tenant may push only onto its own RQ queue
`<queue>:t:<tenant>` (one per configured queue; its Redis ACL user may `RPUSH`/`LPUSH` nothing else:
`ltx_contract.redis_acl`). A worker serves, per configured queue in priority order, the shared queue (operators,
the worker's own re-queues of jobs enqueued there) and every tenant's queue, and:
- **takes tenants in turn** (`rotate`): after a job from one queue, the next queue of the same priority
  comes first, so a tenant with a long queue cannot keep another waiting behind it;
- **checks every id before it runs** (`entry_problem`): the hash exists, its RQ status is `queued` (never
  an ended job: finished, failed, stopped, canceled, nor one running elsewhere), its `origin` is the queue
  it was taken from, and on a tenant queue the id carries that tenant's prefix. An id failing any of these
  is dropped from RQ's intermediate list without being counted or run
  (`ltx_worker_dropped_queue_entries_total{reason}`); its hash, if any, is left alone (it is not this
  queue's to record);
- **bounds the work of one dequeue** (`TakingQueue.dequeue_any`): at most `JUNK_PER_QUEUE` entries are
  dropped from one queue per dequeue before the next queue is looked at; a dequeue that found only junk
  returns empty-handed (the worker's loop beats, checks its fleet and comes back; a burst worker goes on
  until the queues are empty). RQ's own dequeue skips missing ids in one unbounded loop, over the whole
  queue;
- **counts each tenant on its own** (`TenantAdmissions`): `LTX_MAX_QUEUE_DEPTH` and `LTX_CLIENT_QUOTA` hold
  per tenant over its own queues (and, for the shared queues, over them together), each by its own
  `worker.jobs.admission.Admission` pass; nothing one tenant pushes is in another's count, and the producer counts
  the same queues (`producer.client.ProducerClient.queue`).

Without `LTX_TENANTS` (one user, no ACL: the development default) the worker serves the configured queues
as before; the checks on each id and the bound per dequeue hold there too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.queue import Queue

from ltx_contract.keys import CANCEL_REQUESTED_FIELD, base_queue, job_tenant, queue_tenant, tenant_queue
from ltx_contract.redis_conn import single_try
from worker.jobs.admission import Admission
from worker.jobs.lost_pops import LostPops

__all__ = ["JUNK_PER_QUEUE", "TakingQueue", "TenantAdmissions", "entry_problem", "rotate", "served_queue_names"]

log = logging.getLogger("worker.rq")

JUNK_PER_QUEUE = 100  #: entries one dequeue drops from one queue at most before it looks at the next


def served_queue_names(queues: Sequence[str], tenants: Sequence[str]) -> list[str]:
    """What a worker serves, in priority order: per configured queue, the shared one then each tenant's."""
    return [name for q in queues for name in (q, *(tenant_queue(q, t) for t in tenants))]


def rotate(ordered: Sequence[Any], taken: Any, name: Callable[[Any], str] = str) -> list[Any]:
    """`ordered` with the queues of `taken`'s priority (same configured queue) turned so that the one after
    `taken` comes first; other priorities keep their places (round robin among tenants, never across
    priorities)."""
    items = list(ordered)
    group = base_queue(name(taken))
    slots = [i for i, q in enumerate(items) if base_queue(name(q)) == group]
    members = [items[i] for i in slots]
    try:
        pos = [name(q) for q in members].index(name(taken))
    except ValueError:
        return items
    turned = members[pos + 1 :] + members[: pos + 1]
    for i, q in zip(slots, turned, strict=True):
        items[i] = q
    return items


def entry_problem(connection: Any, queue_name: str, raw_id: bytes | str, job_key: Callable[[str], str]) -> str | None:
    """Why the id `raw_id` taken from queue `queue_name` must not run or count (a drop reason), or None.
    One round trip; reads three short fields of the hash only."""
    try:  # (an id `check_job_id` refuses but with a queued hash runs into the worker's refusal, recorded)
        job_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
    except UnicodeDecodeError:
        return "malformed"
    tenant = queue_tenant(queue_name)
    if tenant is not None and job_tenant(job_id) != tenant:
        return "wrong_tenant"  # (checked before any read: another tenant's hash is not this queue's business)
    status, origin, cancel = connection.hmget(job_key(job_id), "status", "origin", CANCEL_REQUESTED_FIELD)
    if status is None:
        return "no_job"
    if status.decode(errors="replace") != "queued" and not (cancel is not None and status == b"canceled"):
        return "not_queued"  # (a tenant's cancel of a waiting job: the worker records it, never runs it)
    if origin is None or origin.decode(errors="replace") != queue_name:
        return "wrong_queue"
    return None


class TakingQueue(Queue):
    """RQ's `Queue` with a dequeue that checks each id and bounds its work (the module docstring). A worker
    gets its own subclass (`with_hook`) so drops are counted in its metrics."""

    on_drop: Callable[[str, str, str], None] | None = None  #: (queue, job id, reason)
    lost_pops: LostPops | None = None  #: told of every multi-queue wait whose reply was lost

    @classmethod
    def with_hook(cls, on_drop: Callable[[str, str, str], None], lost_pops: LostPops | None = None
                  ) -> type[TakingQueue]:  # fmt: skip
        return type("TakingQueue", (cls,), {"on_drop": staticmethod(on_drop), "lost_pops": lost_pops})

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Any, job_class: Any = None,
                    serializer: Any = None, death_penalty_class: Any = None) -> tuple[Any, Queue] | None:  # fmt: skip
        """The first valid job, queues in order (each id moved to its queue's intermediate list first, as
        RQ's single-queue dequeue does, so a worker that dies holding it leaves it to RQ's cleanup); None or
        DequeueTimeout as RQ's when there is none."""
        queues = list(queues)
        job_cls = job_class or cls.job_class
        while True:
            pending = False  # junk left behind in some queue: do not block, come back at once
            for queue in queues:
                for _ in range(JUNK_PER_QUEUE):
                    raw = connection.lmove(queue.key, IntermediateQueue.get_intermediate_queue_key(queue.key))
                    if raw is None:
                        break
                    taken = cls._checked(queue, raw, connection, job_cls, serializer)
                    if taken is not None:
                        return taken
                else:
                    pending = True
            if not pending:
                break
            if timeout is not None:
                return None  # (a burst worker, timeout None, goes on: it stops only once the queues are empty)
        if timeout is None:
            return None
        keys = [q.key for q in queues]
        if len(queues) == 1:  # RQ's own blocking move, atomic
            raw = connection.blmove(keys[0], IntermediateQueue.get_intermediate_queue_key(keys[0]), timeout)
            if raw is None:
                raise DequeueTimeout(timeout, keys[0])
            return cls._checked(queues[0], raw, connection, job_cls, serializer)
        # Every queue was empty: wait for a push on any of them. BLPOP has no multi-key move: the id goes to
        # the intermediate list right after (RQ's multi-queue dequeue never put it there at all). Sent once
        # (redis-py would send it again after a lost reply, and the id it took would be gone unnoticed): a
        # lost reply is reported to `worker.jobs.lost_pops`, whose sweep finds the id's job, and raised as the
        # connection error RQ's dequeue loop waits out.
        began = time.time()
        try:
            result = single_try(connection).blpop(keys, timeout)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if cls.lost_pops is not None:
                cls.lost_pops.suspect([q.name for q in queues], began)
            if isinstance(exc, redis.ConnectionError):
                raise
            raise redis.ConnectionError(f"waiting for a job: {exc}") from exc
        if result is None:
            raise DequeueTimeout(timeout, keys)
        key, raw = result
        key = key.decode() if isinstance(key, bytes) else key
        queue = next(q for q in queues if q.key == key)
        connection.rpush(IntermediateQueue.get_intermediate_queue_key(queue.key), raw)
        return cls._checked(queue, raw, connection, job_cls, serializer)

    @classmethod
    def _checked(cls, queue: Queue, raw: bytes, connection: Any, job_cls: Any, serializer: Any) -> Any:
        """(job, queue) for a valid id; None after dropping an invalid one from the intermediate list."""
        problem = entry_problem(connection, queue.name, raw, job_cls.key_for)
        job_id = raw.decode(errors="replace")
        if problem is None:
            try:
                return job_cls.fetch(job_id, connection=connection, serializer=serializer), queue
            except NoSuchJobError:
                problem = "no_job"  # (expired since the check)
            except Exception as exc:  # the worker records an unreadable hash (FleetWorker._dequeue)
                exc.job_id = job_id  # type: ignore[attr-defined]
                exc.queue = queue  # type: ignore[attr-defined]
                raise
        connection.lrem(IntermediateQueue.get_intermediate_queue_key(queue.key), 1, raw)
        if cls.on_drop is not None:
            cls.on_drop(queue.name, job_id[:80], problem)
        return None


class TenantAdmissions:
    """One `worker.jobs.admission.Admission` per tenant (over that tenant's queues, in priority order) and one
    over the shared queues: depth caps and quotas that no other tenant's entries reach."""

    def __init__(self, connection: Any, queues: Sequence[Queue], **kwargs: Any) -> None:
        groups: dict[str | None, list[Queue]] = {}
        for q in queues:
            groups.setdefault(queue_tenant(q.name), []).append(q)
        self.by_tenant = {tenant: Admission(connection, qs, **kwargs) for tenant, qs in groups.items()}
        self.connection = connection

    @property
    def enabled(self) -> bool:
        return any(a.enabled for a in self.by_tenant.values())

    def before_dequeue(self, tick: Callable[[], Any] | None = None) -> None:
        """Record pending refusals; a pass over each tenant with more than the cap waiting (one round trip
        of LLENs for all of them otherwise)."""
        if not self.enabled:
            return
        first = next(iter(self.by_tenant.values()))
        first.drain(tick=tick)
        if first.depth_cap is None:
            return
        admissions = list(self.by_tenant.values())
        with self.connection.pipeline(transaction=False) as pipe:
            for a in admissions:
                for q in a.queues:
                    pipe.llen(q.key)
            lengths = iter(pipe.execute())
        over = [a for a in admissions if sum(next(lengths) for _ in a.queues) > a.depth_cap]  # type: ignore[operator]
        for a in over:
            a.police(None)
        if over:
            first.drain(tick=tick)

    def admit(self, job: Job, queue: Queue, tick: Callable[[], Any] | None = None) -> bool:
        return self.by_tenant[queue_tenant(queue.name)].admit(job, queue, tick=tick)
