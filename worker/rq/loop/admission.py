"""Worker-side admission: the queue-depth cap and the per-client quota hold whatever a client wrote.

The producer checks both at submit (`producer.admission`: the early answer, with a clear refusal). A client
that skips it (a raw `Queue.enqueue`, an RPUSH, `--max-queue-depth 0`) could otherwise flood the queue
without limit, under any `client` name, so every worker polices the queues it serves, at each dequeue, with no
producer cooperation (`LTX_MAX_QUEUE_DEPTH`, `LTX_CLIENT_QUOTA`; the same variables the producer reads).

**The rule.** One pass looks at one consistent snapshot (WATCH on the worker's queue lists and RQ's
started registries, then MULTI/EXEC for what it changes) and lists the unfinished jobs it sees in serving
order: the running ones (started registries of the worker's queues), then the job this worker just took
(if any), then the waiting ones (queues in priority order, each from head to tail). Walking that order,
a job is admitted unless
- its owner (meta `client`; none: `anonymous`, see `ltx_contract.keys.job_owner`; with tenant job ids, only a
  client that is also the id's tenant prefix: a tenant cannot spend another's quota) already has `quota` admitted
  jobs before it (`quota_exceeded`), or
- `max_queue_depth` waiting jobs are already admitted before it (`queue_full`: the newest plain enqueues).
Running jobs are always admitted (they count, they are never stopped). An entry that is not a waiting job
(no hash, an ended job, a repeat: `ltx_contract.queue_depth`, the rule the producer counts by too) counts
for nothing, so junk pushed onto a shared queue cannot end a job behind it; a job with a malformed owner
counts for nobody's quota (it is refused as `invalid_request` when taken: `worker.rq.loop.job_class`).

**Producer-admitted jobs never trip it.** The producer admits a job only while fewer than `max_queue_depth`
jobs wait and fewer than `quota` jobs of its client are unfinished, in one transaction; so at every instant
at most that many wait, and at most `quota` of a client's jobs are unfinished. A pass decides on one such
instant, where no producer-admitted job can be past either limit. (Both sides need the same `LTX_QUEUES`
and limits; compose passes the same values to both.)

**What it guarantees.** A pass runs before every dequeue (only when more than the cap wait: one round trip
of LLENs otherwise) and right after it. The worker decides when it looks, not when a job was enqueued: a
flood already waiting when the worker looks renders exactly `max_queue_depth` jobs (the oldest) and, per
client, exactly `quota` (counting its running ones); a flood that arrives while the worker is idle renders
at most one more (the job it was blocked waiting for is taken at once, as the producer would admit it into
an empty queue). A client whose jobs arrive as earlier ones finish is never refused (nor would the producer
refuse it). Statuses and owners are read for the first `QUOTA_WINDOW` entries only: both rules are exact
within them; entries further back count for nothing and are trimmed only once the cap's worth of jobs is
found ahead of them (otherwise they are judged once they move up).

**Nothing is lost.** Refused jobs leave their queue in the same transaction that moves them onto the
`ltx_contract.keys.REFUSALS_KEY` list; from there they are recorded (meta error, a `failed` state event, RQ's
failed registry and a failure result, `ltx_worker_jobs{outcome="failed",reason}`) in batches by one worker
at a time, idempotently: a worker killed in between leaves them for the next pass, never queued again.

**Cost** (measured in `bench/admission.py`): a pass reads the first `QUOTA_WINDOW` waiting ids and each
one's status in one pipelined round trip (with a depth cap, a queue holds no more than the cap once
trimmed, so that is the cap's worth in steady state); with the quota on, metas are read once per job
(owners cached). Without the quota, a pass over queues holding no more than the cap is one round trip
of LLENs. A depth trim removes its excess in one transaction
of at most `_TRIM_RECORDED` ids past the window (the newest; a bigger excess leaves over the next passes,
one before each dequeue, so a job taken in between waits for one pass, not for the whole excess). Refusals
of ids without a hash are recorded with one pipelined status read per batch. Nothing here is O(queue
length) per dequeue. With tenant queues
(`worker.jobs.tenant_queues`, `worker.rq.loop.queues`) each tenant's queues get a pass of their own.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from ltx_contract.keys import REFUSALS_KEY, job_owner, job_tenant
from ltx_contract.queue_depth import DEPTH_WINDOW, counts_as_waiting
from ltx_contract.states import FailureReason, JobState
from worker.jobs.admission_rule import STALE, Owner, Refusal, Waiting, plan
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Failure
from worker.jobs.outcomes import JobOutcomes
from worker.rq.loop.registries import started_member_job_id
from worker.rq.loop.unstarted import fail_unreadable, fail_unstarted
from worker.rq.record import JobRecord

__all__ = ["QUOTA_WINDOW", "Admission"]

log = logging.getLogger("worker.jobs.admission")

QUOTA_WINDOW = DEPTH_WINDOW  #: queue entries (from the heads of the queues) whose status and owner a pass reads
_WATCH_ATTEMPTS = 20  # a pass that keeps racing with enqueues/dequeues is skipped (the next one retries)
_DRAIN_BATCH = 200  # refusals recorded per round trip of the drain
_DRAIN_AFTER_TAKE = 1000  # refusals recorded before a taken job starts (the rest: before the next dequeue)
_LOCK_KEY = REFUSALS_KEY + ":lock"  # one drainer at a time
_LOCK_TTL_S = 60
_OWNER_CACHE = 4 * QUOTA_WINDOW
#: Ids past the window one pass takes off a queue (the newest): a pass's time is bounded, not the queue's length.
_TRIM_RECORDED = QUOTA_WINDOW

# ==== the passes (Redis) ==================================================================================


@dataclass(eq=False)
class Admission:
    """The passes of one worker over its queues; see the module docstring."""

    connection: redis.Redis
    queues: Sequence[Queue]  #: (kept as a list)
    _: KW_ONLY
    depth_cap: int | None
    quota: int | None
    outcomes: JobOutcomes
    job_class: Any
    worker_name: str
    max_meta_bytes: int
    tenant_ids: bool = False  #: owners must match the id's tenant prefix (LTX_TENANT_IDS)
    #: job id -> owner, read once per job
    _owners: OrderedDict[str, Owner] = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.queues = list(self.queues)

    @property
    def enabled(self) -> bool:
        return self.depth_cap is not None or self.quota is not None

    # ---- before and after a dequeue ------------------------------------------------------------------
    def before_dequeue(self, tick: Callable[[], Any] | None = None) -> None:
        """Record pending refusals; trim the queues if more than the cap wait (one LLEN each otherwise)."""
        if not self.enabled:
            return
        self.drain(tick=tick)
        if self.depth_cap is not None:
            with self.connection.pipeline(transaction=True) as pipe:
                for q in self.queues:
                    pipe.llen(q.key)
                waiting = sum(pipe.execute())
            if waiting > self.depth_cap:
                self.police(None)
                self.drain(tick=tick)

    def admit(self, job: Job, queue: Queue, tick: Callable[[], Any] | None = None) -> bool:
        """The pass right after `job` was taken from `queue`: False when `job` itself is refused (it left the
        intermediate list for the refusals list; do not run it). Refusals are recorded before it starts."""
        if not self.enabled:
            return True
        admitted = self.police((job, queue))
        self.drain(limit=_DRAIN_AFTER_TAKE, tick=tick)
        return admitted

    # ---- one pass ------------------------------------------------------------------------------------
    def police(self, taken: tuple[Any, Queue] | None) -> bool:
        """One pass on one consistent snapshot; returns False when the taken job was refused."""
        conn = self.connection
        keys = [q.key for q in self.queues]
        started = [q.started_job_registry.key for q in self.queues] if self.quota is not None else []
        taken_id = taken[0].id if taken is not None else None
        for _ in range(_WATCH_ATTEMPTS):
            with conn.pipeline() as pipe:
                try:
                    pipe.watch(*keys, *started)
                    lengths = [int(pipe.llen(k)) for k in keys]
                    if self.quota is None and sum(lengths) <= (self.depth_cap or 0):
                        pipe.reset()  # (no more entries than the cap: none can be past it)
                        return True
                    windows: list[list[str]] = []
                    budget = QUOTA_WINDOW
                    for key, length in zip(keys, lengths, strict=True):
                        n = min(length, budget)
                        windows.append([i.decode() for i in pipe.lrange(key, 0, n - 1)] if n else [])
                        budget -= n
                    running: list[str] = []
                    for key in started:
                        for member in pipe.zrange(key, 0, -1):
                            job_id = started_member_job_id(member)
                            if job_id != taken_id and job_id not in running:
                                running.append(job_id)
                    owners = self._owners_of(
                        [*running, *(i for w in windows for i in w)], read_owners=self.quota is not None
                    )
                    taken_arg = None
                    if taken is not None:
                        owner = _owner_of_meta(taken[0].meta, taken_id if self.tenant_ids else None)
                        taken_arg = (taken_id, taken[1].name, owner)
                    decided = plan(
                        [owners[i] for i in running],
                        taken_arg,
                        [
                            Waiting(q.name, n, [(i, owners[i]) for i in w])
                            for q, n, w in zip(self.queues, lengths, windows, strict=True)
                        ],
                        depth_cap=self.depth_cap,
                        quota=self.quota,
                        running_ids=running,
                    )
                    # Per queue, everything from the cut on leaves, the newest _TRIM_RECORDED per pass (the
                    # rest in the next passes, one before each dequeue): LTRIM keeps [0, end). Refused are the
                    # jobs in [end, n) as the plan labels them (in the window; junk there leaves unrecorded)
                    # and every id past the window (unknown; the drain skips those with no hash), and the
                    # window's quota refusals before the cut (LREM).
                    refusals: list[Refusal] = []
                    ends: list[int] = []
                    removes: list[list[str]] = []  # per queue: LREM these
                    for q, key, n, w, cut, refused in zip(
                        self.queues, keys, lengths, windows, decided.cuts, decided.refused, strict=True
                    ):
                        end = max(cut, n - _TRIM_RECORDED) if cut < n else n
                        position = {job_id: pos for pos, job_id in reversed(list(enumerate(w)))}
                        for r in refused:
                            if r.reason is FailureReason.QUOTA_EXCEEDED:
                                refusals.append(r)
                            elif position.get(r.job_id, n) >= end:
                                refusals.append(r)  # (trimmed now; those before `end`: a later pass)
                        removes.append([r.job_id for r in refused if r.reason is FailureReason.QUOTA_EXCEEDED])
                        if max(end, len(w)) < n:  # ids past the window that leave now
                            extra = pipe.lrange(key, max(end, len(w)), -1)
                            details = {"depth": sum(lengths), "cap": self.depth_cap}
                            refusals += [Refusal(i.decode(), q.name, FailureReason.QUEUE_FULL, details) for i in extra]
                        ends.append(end)
                    trims = any(e < n for e, n in zip(ends, lengths, strict=True))
                    if decided.taken is None and not refusals and not trims:
                        pipe.reset()
                        return True
                    pipe.multi()
                    for key, n, end, remove in zip(keys, lengths, ends, removes, strict=True):
                        if end < n:
                            if end > 0:
                                pipe.ltrim(key, 0, end - 1)
                            else:
                                pipe.delete(key)
                        for job_id in remove:
                            pipe.lrem(key, 1, job_id)
                    if decided.taken is not None:
                        pipe.lrem(taken[1].intermediate_queue_key, 1, taken_id)
                        refusals.insert(0, decided.taken)
                    if refusals:
                        pipe.rpush(REFUSALS_KEY, *(r.to_json() for r in refusals))
                    pipe.execute()
                except redis.WatchError:
                    continue
            counts = {reason: sum(r.reason is reason for r in refusals) for reason in FailureReason}
            log.warning(
                "admission: %d job(s) past the queue-depth cap (%s) and %d past a client quota (%s) "
                "ended without running%s",
                counts[FailureReason.QUEUE_FULL],
                self.depth_cap,
                counts[FailureReason.QUOTA_EXCEEDED],
                self.quota,
                f", the taken job {taken_id} among them" if decided.taken else "",
            )
            return decided.taken is None
        log.warning("admission pass skipped: the queues kept changing under it (the next dequeue retries)")
        return True

    def _owners_of(self, ids: Sequence[str], *, read_owners: bool = True) -> dict[str, Owner]:
        """Owner (or STALE: not a waiting job, `ltx_contract.queue_depth.counts_as_waiting`) of each job:
        status and meta length of all in one round trip, metas only of jobs not seen before (and within the
        meta limit: a bigger one is refused when taken). Without `read_owners` (no quota to count) only the
        statuses are read and a waiting job's owner is None."""
        conn = self.connection
        unique = list(dict.fromkeys(ids))
        pipe = conn.pipeline(transaction=False)
        for job_id in unique:
            key = self.job_class.key_for(job_id)
            pipe.hget(key, "status")
            if read_owners and job_id not in self._owners:
                pipe.hstrlen(key, "meta")
        replies = iter(pipe.execute())
        out: dict[str, Owner] = {}
        fetch: list[str] = []
        for job_id in unique:
            status = next(replies)
            meta_len = int(next(replies) or 0) if read_owners and job_id not in self._owners else 0
            if not counts_as_waiting(status):
                out[job_id] = STALE
            elif not read_owners:
                out[job_id] = None
            elif job_id in self._owners:
                out[job_id] = self._owners[job_id]
            elif meta_len > self.max_meta_bytes:
                out[job_id] = None
            else:
                fetch.append(job_id)
        if fetch:
            pipe = conn.pipeline(transaction=False)
            for job_id in fetch:
                pipe.hget(self.job_class.key_for(job_id), "meta")
            for job_id, raw in zip(fetch, pipe.execute(), strict=True):
                try:
                    meta = json.loads(raw) if raw else {}
                except ValueError:
                    meta = {}  # (RQ keeps it as text: no `client` in it)
                owner = _owner_of_meta(meta, job_id if self.tenant_ids else None)
                out[job_id] = self._owners[job_id] = owner
        while len(self._owners) > _OWNER_CACHE:
            self._owners.popitem(last=False)
        return out

    # ---- recording -----------------------------------------------------------------------------------
    def drain(self, *, limit: int | None = None, tick: Callable[[], Any] | None = None) -> int:
        """Record pending refusals (all, or about `limit`), a batch per round trip, one worker at a time."""
        conn = self.connection
        if not conn.llen(REFUSALS_KEY):
            return 0
        if not conn.set(_LOCK_KEY, self.worker_name, nx=True, ex=_LOCK_TTL_S):
            return 0  # another worker is recording them
        done = 0
        try:
            while limit is None or done < limit:
                batch = conn.lrange(REFUSALS_KEY, 0, _DRAIN_BATCH - 1)
                if not batch:
                    break
                self._record_batch(batch)
                conn.ltrim(REFUSALS_KEY, len(batch), -1)  # (only the lock holder removes from the head)
                done += len(batch)
                conn.expire(_LOCK_KEY, _LOCK_TTL_S)
                if tick is not None:
                    tick()
        finally:
            if conn.get(_LOCK_KEY) == self.worker_name.encode():
                conn.delete(_LOCK_KEY)
        return done

    def _record_batch(self, batch: Sequence[bytes]) -> None:
        """Record a batch: one pipelined status read; only ids with a hash are loaded (junk costs no more)."""
        parsed: list[tuple[bytes, Refusal | None]] = []
        for raw in batch:
            try:
                parsed.append((raw, Refusal.from_json(raw)))
            except (ValueError, KeyError, TypeError):
                parsed.append((raw, None))
        pipe = self.connection.pipeline(transaction=False)
        for _, refusal in parsed:
            if refusal is not None:
                pipe.hget(self.job_class.key_for(refusal.job_id), "status")
        statuses = iter(pipe.execute())
        for raw, refusal in parsed:
            if refusal is None or next(statuses) is not None:  # (`_record` reads the job and decides)
                self._record(raw)

    def _record(self, raw: bytes) -> None:
        """End one refused job as failed (idempotent: a re-drain after a crash records it once more at most
        in RQ's bookkeeping, never a second `failed` event)."""
        try:
            refusal = Refusal.from_json(raw)
        except (ValueError, KeyError, TypeError):
            log.warning("admission: dropped an unreadable refusal entry %r", raw[:200])
            return
        conn = self.connection
        try:
            job = self.job_class.fetch(refusal.job_id, connection=conn, serializer=JSONSerializer)
        except NoSuchJobError:
            return
        except Exception as exc:
            queue = Queue(refusal.queue, connection=conn)
            fail_unreadable(conn, refusal.job_id, queue, exc, self.outcomes.settings.failure_ttl)
            return
        if job.get_status(refresh=False) != JobStatus.QUEUED:
            return  # already recorded, or not a job a pass took out of a queue
        meta = job.meta if isinstance(job.meta, dict) else {}
        error = meta.get("error") if isinstance(meta.get("error"), dict) else {}
        message = refusal.message()
        if not (meta.get("state") == JobState.FAILED.value and error.get("reason") == refusal.reason.value):
            failure = Failure(refusal.reason, message, retryable=False, details=refusal.details)
            JobAttempt(JobRecord(job), self.outcomes).decide(failure, quiet=True)
        fail_unstarted(job, message, self.outcomes.failure_ttl(job.failure_ttl), self.worker_name)


def _owner_of_meta(meta: Any, tenant_job_id: str | None = None) -> Owner:
    """The owner a job counts against, or None (counts for nobody): a malformed one, or, with tenant ids
    (`tenant_job_id` given), a recorded client that is not the id's tenant. Both are refused as
    invalid_request when taken (`worker.rq.loop.job_class`); until then a forged owner must not fill another
    client's quota (a tenant can create only its own ids, but writes the meta itself)."""
    try:
        owner = job_owner(meta)
    except ValueError:
        return None
    if tenant_job_id is not None and job_tenant(tenant_job_id) != owner:
        return None
    return owner
