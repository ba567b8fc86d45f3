"""The RQ side of tenant queues (`worker.jobs.tenant_queues` has the rules): a dequeue that checks each id
before it counts or runs (`entry_problem`) and bounds its work per queue (`TakingQueue.dequeue_any`, in place of
RQ's `Queue.dequeue_any`, moving each id to RQ's intermediate list first), and one admission pass per tenant
(`TenantAdmissions`, each a `worker.rq.loop.admission.Admission`)."""

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

from ltx_contract.keys import CANCEL_REQUESTED_FIELD, job_tenant, queue_tenant
from ltx_contract.redis_conn import single_try
from worker.rq.loop.admission import Admission
from worker.rq.loop.lost_pops import LostPops

__all__ = ["JUNK_PER_QUEUE", "TakingQueue", "TenantAdmissions", "entry_problem"]

log = logging.getLogger("worker.rq")

JUNK_PER_QUEUE = 100  #: entries one dequeue drops from one queue at most before it looks at the next


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
    def with_hook(
        cls, on_drop: Callable[[str, str, str], None], lost_pops: LostPops | None = None
    ) -> type[TakingQueue]:
        return type("TakingQueue", (cls,), {"on_drop": staticmethod(on_drop), "lost_pops": lost_pops})

    @classmethod
    def dequeue_any(
        cls,
        queues: Iterable[Queue],
        timeout: int | None,
        connection: Any,
        job_class: Any = None,
        serializer: Any = None,
        death_penalty_class: Any = None,
    ) -> tuple[Any, Queue] | None:
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
        # lost reply is reported to `worker.rq.loop.lost_pops`, whose sweep finds the id's job, and raised as the
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
            except Exception as exc:  # the worker records an unreadable hash (RqWorker._dequeue)
                exc.job_id = job_id  # type: ignore[attr-defined]
                exc.queue = queue  # type: ignore[attr-defined]
                raise
        connection.lrem(IntermediateQueue.get_intermediate_queue_key(queue.key), 1, raw)
        if cls.on_drop is not None:
            cls.on_drop(queue.name, job_id[:80], problem)
        return None


class TenantAdmissions:
    """One `worker.rq.loop.admission.Admission` per tenant (over that tenant's queues, in priority order) and one
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
