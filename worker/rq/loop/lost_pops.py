"""Jobs whose id a lost reply took off every list: found after the loss and queued again.

An idle worker that serves several queues waits for a push on any of them with BLPOP (Redis has no blocking
move from several lists: `worker.rq.loop.queues`). Redis takes the id off its queue when it runs the
BLPOP; the worker then records it in RQ's intermediate list. If the connection drops after Redis ran the
BLPOP and before its reply arrived (a restart, a network cut), the id is in no list, and the job would stay
`queued` forever without running. (redis-py would even send the BLPOP again by itself and hide the error:
the wait goes through `ltx_contract.redis_conn.single_try`, so the worker knows.)

After such an error (`LostPops.suspect`), once Redis answers again, the worker looks for jobs that are
`queued`, belong to a queue the BLPOP waited on, were enqueued no earlier than `ENQUEUE_SLACK_S` before the
BLPOP began (the lost id was pushed while it waited; the slack covers clocks that differ between the
enqueuer and the worker), and are in no list (their queue, its intermediate list, the admission's refusals).
It checks each again `CONFIRM_S` later (another worker's own BLPOP holds its id for a moment before its
intermediate list) and puts it back at the head of its queue, where it was taken from, in a transaction
that WATCHes its hash and lists (a job that moved meanwhile is left alone). With tenant queues a tenant's
job goes back only onto its own queue and no tenant's id onto a shared one: tenants write their own job
hashes, and a hash must not get onto a queue its tenant cannot push to.

The search is a SCAN over the job hashes, pipelined: it runs only after a lost wait, which is rare. A lost
wait takes one id, so at most `MAX_PER_QUEUE` jobs of a queue (the newest) are queued again per sweep. One
sweep scans at most `SWEEP_MAX_KEYS` keys and `SWEEP_MAX_S` seconds, then returns with the SCAN cursor kept:
the next dequeue's sweep continues from it (a tenant's 200,000 hashes took one sweep 22 s before this bound;
now they spread over dequeues of a fraction of a second each, and the worker keeps taking jobs meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.queue import Queue
from rq.utils import utcparse

from ltx_contract.keys import REFUSALS_KEY, job_tenant, queue_tenant
from worker.jobs.admission_rule import Refusal

__all__ = [
    "CONFIRM_S",
    "ENQUEUE_SLACK_S",
    "MAX_PER_QUEUE",
    "SWEEP_MAX_KEYS",
    "SWEEP_MAX_S",
    "LostPops",
    "Orphan",
    "find_orphans",
    "requeue_orphan",
    "scan_orphans",
]

log = logging.getLogger("worker.jobs.lost_pops")

ENQUEUE_SLACK_S = 300.0  #: how much earlier than the lost BLPOP a job may say it was enqueued (clock skew)
#: orphans queued again per queue and sweep, the newest: a lost wait takes one id, so a queue with more is
#: mostly hashes a client wrote and never pushed: a sweep's time must not grow with how many a tenant wrote
MAX_PER_QUEUE = 16
CONFIRM_S = 5.0  #: a job is queued again only if it is still in no list this much later (a loaded host
#: can pause a worker between its BLPOP and its intermediate list for seconds)
SWEEP_MAX_KEYS = 20_000  #: keys one sweep scans at most (about 0.3 s on the CPU VM); the next one continues
SWEEP_MAX_S = 1.0  #: seconds one sweep scans at most
_JOB_KEY_PREFIX = Job.redis_job_namespace_prefix.encode()
_SCAN_BATCH = 500
_WATCH_TRIES = 32


@dataclass(frozen=True)
class Orphan:
    """A `queued` job in no list: its id, its queue and its submission (RQ `created_at`, raw)."""

    job_id: str
    origin: str
    created_at: bytes | None


def _queue_key(name: str) -> str:
    return Queue.redis_queue_namespace_prefix + name


def _intermediate_key(name: str) -> str:
    return IntermediateQueue.get_intermediate_queue_key(_queue_key(name))


def _batched(items: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _timestamp(raw: bytes | None) -> float | None:
    """RQ's `enqueued_at` as a Unix time; None if absent or malformed (a hand-written hash)."""
    if not raw:
        return None
    try:
        return utcparse(raw.decode()).timestamp()
    except (UnicodeDecodeError, ValueError):
        return None


def may_requeue(job_id: str, origin: str, tenants: Sequence[str]) -> bool:
    """Whether a job of id `job_id` may be put on queue `origin`: a tenant queue takes only its tenant's ids,
    and, where tenants have queues of their own, a shared queue takes no tenant's id."""
    owner = queue_tenant(origin)
    if owner is not None:
        return job_tenant(job_id) == owner
    return not tenants or job_tenant(job_id) not in tenants


def _refused_ids(raw_entries: Iterable[bytes]) -> set[bytes]:
    ids: set[bytes] = set()
    for raw in raw_entries:
        try:
            ids.add(Refusal.from_json(raw).job_id.encode())
        except (ValueError, KeyError, TypeError):
            continue  # (the admission's drain drops it)
    return ids


def _listed(connection: Any, origins: set[str]) -> set[bytes]:
    """Every id in the queues `origins`, their intermediate lists and the admission's refusals."""
    pipe = connection.pipeline(transaction=False)
    for name in sorted(origins):
        pipe.lrange(_queue_key(name), 0, -1)
        pipe.lrange(_intermediate_key(name), 0, -1)
    pipe.lrange(REFUSALS_KEY, 0, -1)
    *lists, refusals = pipe.execute()
    return {i for ids in lists for i in ids} | _refused_ids(refusals)


def find_orphans(
    connection: Any, queue_names: Iterable[str], enqueued_after: float, tenants: Sequence[str] = ()
) -> list[Orphan]:
    """`queued` jobs of `queue_names` enqueued at or after `enqueued_after` (Unix time) that are in no list
    and `may_requeue` allows back onto their queue: the newest `MAX_PER_QUEUE` of each queue (a whole scan)."""
    found, cursor = scan_orphans(connection, queue_names, enqueued_after, tenants, max_keys=None, max_s=None)
    assert cursor == 0
    return found


def scan_orphans(
    connection: Any,
    queue_names: Iterable[str],
    enqueued_after: float,
    tenants: Sequence[str] = (),
    *,
    cursor: int = 0,
    max_keys: int | None = SWEEP_MAX_KEYS,
    max_s: float | None = SWEEP_MAX_S,
) -> tuple[list[Orphan], int]:
    """`find_orphans` over one slice of the SCAN from `cursor`, ending after `max_keys` keys or `max_s` seconds
    (None: no bound): (what the slice found, the cursor to continue from; 0 when the scan is complete)."""
    names = set(queue_names)
    found: list[tuple[float, Orphan]] = []
    scanned, t0 = 0, time.monotonic()
    while True:
        cursor, keys = connection.scan(cursor, match=_JOB_KEY_PREFIX + b"*", count=1000)
        scanned += len(keys)
        for batch in _batched(keys, _SCAN_BATCH):
            found.extend(_queued_in(connection, batch, names, enqueued_after, tenants))
        if cursor == 0:
            break
        if (max_keys is not None and scanned >= max_keys) or (max_s is not None and time.monotonic() - t0 >= max_s):
            break
    if not found:
        return [], int(cursor)
    listed = _listed(connection, {o.origin for _, o in found})
    per_queue: dict[str, list[Orphan]] = {}
    for _, orphan in sorted(found, key=lambda pair: pair[0], reverse=True):  # (newest first)
        if orphan.job_id.encode() not in listed:
            per_queue.setdefault(orphan.origin, []).append(orphan)
    for queue, orphans in per_queue.items():
        if len(orphans) > MAX_PER_QUEUE:
            log.warning(
                "%d queued jobs of queue %s are in no list; only the newest %d are queued again (a lost "
                "wait takes one id: the rest were written by hand)",
                len(orphans),
                queue,
                MAX_PER_QUEUE,
            )
    return [o for orphans in per_queue.values() for o in orphans[:MAX_PER_QUEUE]], int(cursor)


def _queued_in(
    connection: Any, batch: list[bytes], names: set[str], enqueued_after: float, tenants: Sequence[str]
) -> list[tuple[float, Orphan]]:
    pipe = connection.pipeline(transaction=False)
    for key in batch:
        pipe.hmget(key, "status", "origin", "enqueued_at", "created_at")
    out = []
    for key, reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, Exception):
            continue  # (not a hash: `rq:job:<id>:dependents` is a set)
        status, origin, enqueued, created = reply
        if status != b"queued" or origin is None:
            continue
        enqueued_at = _timestamp(enqueued)
        if enqueued_at is None or enqueued_at < enqueued_after:
            continue
        try:
            job_id, queue = key[len(_JOB_KEY_PREFIX) :].decode(), origin.decode()
        except UnicodeDecodeError:
            continue
        if queue in names and may_requeue(job_id, queue, tenants):
            out.append((enqueued_at, Orphan(job_id, queue, created)))
    return out


def requeue_orphan(connection: Any, orphan: Orphan) -> bool:
    """Put `orphan` back at the head of its queue if it is still the same `queued` submission in no list
    (checked under WATCH on its hash, its queue and its intermediate list: an id reaches the refusals only
    through its queue). Returns whether it was queued again."""
    job_key = Job.key_for(orphan.job_id)
    queue, intermediate = _queue_key(orphan.origin), _intermediate_key(orphan.origin)
    with connection.pipeline() as pipe:
        for _ in range(_WATCH_TRIES):
            try:
                pipe.watch(job_key, queue, intermediate)
                status, created = pipe.hmget(job_key, "status", "created_at")
                if status != b"queued" or created != orphan.created_at:
                    return False
                if pipe.lpos(queue, orphan.job_id) is not None or pipe.lpos(intermediate, orphan.job_id) is not None:
                    return False
                if orphan.job_id.encode() in _refused_ids(pipe.lrange(REFUSALS_KEY, 0, -1)):
                    return False
                pipe.multi()
                pipe.lpush(queue, orphan.job_id)
                pipe.execute()
                return True
            except redis.WatchError:
                continue  # (the queue moved: look again)
    return False


class LostPops:
    """The waits of one worker whose reply was lost, and the sweep that finds their jobs.

    `suspect()` is called by the dequeue (`worker.rq.loop.queues.TakingQueue`) when a BLPOP failed with a
    connection error; `sweep()` by the worker before its next dequeues, until one completes."""

    def __init__(
        self,
        tenants: Sequence[str] = (),
        *,
        confirm_s: float = CONFIRM_S,
        sleep: Callable[[float], None] = time.sleep,
        max_keys: int = SWEEP_MAX_KEYS,
        max_s: float = SWEEP_MAX_S,
    ) -> None:
        self.tenants = tuple(tenants)
        self.confirm_s = confirm_s
        self.sleep = sleep
        self.max_keys, self.max_s = max_keys, max_s
        self._since: float | None = None  # Unix time the earliest lost wait began
        self._queues: set[str] = set()
        self._cursor = 0  # where the next sweep's SCAN continues (0: from the start)
        self._requeued: dict[str, int] = {}  # per queue, in this (continued) sweep: at most MAX_PER_QUEUE

    @property
    def pending(self) -> bool:
        return self._since is not None

    def suspect(self, queue_names: Iterable[str], began: float) -> None:
        """A BLPOP on `queue_names` that began at Unix time `began` may have taken an id whose reply was lost."""
        self._since = began if self._since is None else min(self._since, began)
        self._queues.update(queue_names)
        self._cursor = 0  # (its id may be behind the cursor of a sweep under way: scan again from the start)

    def give_up(self) -> None:
        """Forget the lost waits (the sweep cannot run here)."""
        self._since, self._queues, self._cursor, self._requeued = None, set(), 0, {}

    def sweep(self, connection: Any) -> list[str]:
        """Queue again what the lost waits took (see the module docstring); the ids queued again. Redis errors
        propagate and leave the sweep pending."""
        if self._since is None:
            return []
        since, queues = self._since, set(self._queues)
        orphans, cursor = scan_orphans(
            connection,
            queues,
            since - ENQUEUE_SLACK_S,
            self.tenants,
            cursor=self._cursor,
            max_keys=self.max_keys,
            max_s=self.max_s,
        )
        orphans = [o for o in orphans if self._requeued.get(o.origin, 0) < MAX_PER_QUEUE]
        if orphans:
            self.sleep(self.confirm_s)
            orphans = [o for o in orphans if requeue_orphan(connection, o)]
        for orphan in orphans:
            self._requeued[orphan.origin] = self._requeued.get(orphan.origin, 0) + 1
            log.warning(
                "job %s was taken off queue %s by a wait whose reply was lost: queued again at its head",
                orphan.job_id,
                orphan.origin,
            )
        if cursor == 0:
            self.give_up()
        else:
            self._cursor = cursor  # (pending: the next dequeue's sweep continues the scan)
        return [o.job_id for o in orphans]
