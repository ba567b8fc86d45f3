"""Admission control: enqueue a job only if the queue has room and the client has quota, atomically.

A flood of a few hundred long renders can keep a GPU service busy for hours and starve everyone else, so
the producer refuses work past a queue-depth cap (and past an optional per-client quota) instead of
letting the queue grow without bound. The check and the enqueue must be one atomic step, or two producers
racing for the last slot both get in. This uses Redis optimistic locking: WATCH the queue lists, the
client's pending set and the job key; read depths; then MULTI/EXEC RQ's own enqueue (its public
`Queue.enqueue_job(job, pipeline=...)`), so the job hash is written exactly as RQ writes it. If any
watched key changed in between, EXEC fails and the whole decision is made again. If the connection died
during a try (a Redis restart: the EXEC may have run with its reply lost), the next try recognises its own
job by its `created_at` and returns it rather than calling it a duplicate; nothing is pushed twice.

Per-client accounting: each admitted job id is added to a sorted set per client. Entries are pruned
lazily inside the same transaction when their job ended (finished, failed, stopped, canceled) or expired,
so no worker cooperation is needed and a crashed producer never leaks quota for longer than its jobs live.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import redis
from rq import Queue
from rq.job import Job
from rq.utils import utcformat

from ltx_contract.keys import RQ_ENDED_STATUSES, check_client_name
from ltx_contract.queue_depth import waiting_depth
from ltx_contract.rq_client import enqueue_unregistered
from producer.errors import ProducerError

__all__ = [
    "TERMINAL_STATUSES",
    "AdmissionPolicy",
    "AdmissionRefused",
    "JobExists",
    "SubmitRefusal",
    "check_client_name",
    "client_key",
    "enqueue_admitted",
]

CLIENT_KEY_PREFIX = "ltx:producer:client:"  # + <client> + ":jobs" (sorted set of job ids, score = submit time)
CLIENT_KEY_TTL_S = 7 * 24 * 3600  # idle clients' sets disappear on their own
TERMINAL_STATUSES = RQ_ENDED_STATUSES  # (one definition: the worker counts unfinished jobs the same way)
_MAX_ATTEMPTS = 50


def client_key(client: str) -> str:
    return f"{CLIENT_KEY_PREFIX}{client}:jobs"


@dataclass(frozen=True)
class AdmissionPolicy:
    """Limits applied at submit; `None` means unlimited."""

    max_queue_depth: int | None = None  #: waiting jobs across the counted queues (`ltx_contract.queue_depth`)
    client_quota: int | None = None  #: unfinished (queued or running) jobs of one client


@dataclass(frozen=True)
class SubmitRefusal:
    """Why a submit was refused and how full things are."""

    reason: Literal["queue_full", "client_quota"]
    current: int
    limit: int
    queue: str
    client: str | None = None

    def message(self) -> str:
        if self.reason == "queue_full":
            return (
                f"queue {self.queue!r} is full: {self.current}/{self.limit} jobs waiting "
                f"(admission cap); try again when it drains, or use `producer backfill`, which waits"
            )
        return (
            f"client {self.client!r} has {self.current}/{self.limit} unfinished jobs (quota); "
            f"wait for some to finish or cancel one"
        )


class AdmissionRefused(ProducerError, RuntimeError):
    """The submit was refused by admission control; `refusal` says why and how full."""

    def __init__(self, refusal: SubmitRefusal) -> None:
        super().__init__(refusal.message())
        self.refusal = refusal


class JobExists(ProducerError, RuntimeError):
    """A job with this id already exists (backfill uses this to skip work that is done or queued)."""

    def __init__(self, job_id: str, status: str | None) -> None:
        super().__init__(f"job {job_id} already exists (status: {status or 'unknown'})")
        self.job_id = job_id
        self.status = status


def enqueue_admitted(
    queue: Queue,
    job: Job,
    *,
    policy: AdmissionPolicy,
    counted_queues: list[Queue],
    client: str | None,
    at_front: bool = False,
) -> Job:
    """Enqueue `job` on `queue` if `policy` allows it, as one atomic decision.

    `counted_queues` are the queues whose waiting jobs count against `max_queue_depth` (all priority
    levels of one service). Raises AdmissionRefused, or JobExists if `job.id` already exists.
    """
    connection: redis.Redis = queue.connection
    ckey = client_key(client) if client else None
    keys = [q.key for q in counted_queues] + [job.key] + ([ckey] if ckey else [])
    ours = utcformat(job.created_at)  # (RQ's `created_at` names one submission: `worker.rq.record.submission_of`)
    cut = False  # a connection died during a try: its EXEC may have run with the reply lost
    with connection.pipeline() as pipe:
        for _ in range(_MAX_ATTEMPTS):
            try:
                pipe.watch(*keys)
                debris = False
                if pipe.exists(job.key):
                    raw, created = pipe.hmget(job.key, "status", "created_at")
                    if cut and created is not None and created.decode(errors="replace") == ours:
                        pipe.reset()
                        return job  # our own transaction went through (all of it: MULTI/EXEC is atomic)
                    # RQ writes a job's hash whole; one with neither `created_at` nor `data` is a late field
                    # write that recreated a deleted job's key (no client can read it): not a job, replaced
                    debris = created is None and not pipe.hexists(job.key, "data")
                    if not debris:
                        raise JobExists(job.id, raw.decode() if raw else None)
                if policy.max_queue_depth is not None:  # (entries that are not jobs count for nothing)
                    cap = policy.max_queue_depth
                    depth = waiting_depth(pipe, [q.key for q in counted_queues], Job.key_for, cap)
                    if depth >= cap:
                        raise AdmissionRefused(SubmitRefusal("queue_full", depth, cap, queue.name))
                stale: list[bytes] = []
                live = 0
                if ckey:
                    for member in pipe.zrange(ckey, 0, -1):
                        status = pipe.hget(Job.key_for(member.decode()), "status")
                        if status is None or status.decode() in TERMINAL_STATUSES:
                            stale.append(member)
                        else:
                            live += 1
                    if policy.client_quota is not None and live >= policy.client_quota:
                        raise AdmissionRefused(
                            SubmitRefusal("client_quota", live, policy.client_quota, queue.name, client)
                        )
                pipe.multi()
                if debris:
                    pipe.delete(job.key)
                if stale and ckey:
                    pipe.zrem(ckey, *stale)
                enqueue_unregistered(queue, job, pipeline=pipe, at_front=at_front)  # (workers register queues)
                if ckey:
                    pipe.zadd(ckey, {job.id: time.time()})
                    pipe.expire(ckey, CLIENT_KEY_TTL_S)
                pipe.execute()
                return job
            except redis.WatchError as exc:
                # (redis-py turns a connection error while watching into a WatchError, the original as context)
                cut = cut or isinstance(exc.__context__, (redis.ConnectionError, redis.TimeoutError))
                pipe.reset()
                time.sleep(0.001)
                continue
            except (AdmissionRefused, JobExists):
                pipe.reset()
                raise
    raise RuntimeError(f"admission for job {job.id} kept racing with other submits; try again")
