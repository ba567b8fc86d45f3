"""Jobs the worker took off a queue and ends or gives back without running them, as RQ would record them:
given back to the front of their queue (`give_back_dequeued`, `give_back_started`), failed because RQ cannot
load them (`fail_unreadable`) or they are bigger than any job of this service (`drop_oversized`,
`sweep_oversized`), refused by admission (`fail_unstarted`), cancelled by a client while they waited
(`cancel_requested`, `drop_cancelled_dequeued`) or while they ran (`record_cancelled_execution`: `canceled`,
not RQ's `stopped` in its failed registry)."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.utils import now, utcformat

from ltx_contract.keys import CANCEL_REQUESTED_FIELD
from ltx_contract.rq_client import OversizedJob
from worker.rq.loop.worker_state import mark_stopped
from worker.rq.record import submission_of

__all__ = [
    "cancel_requested",
    "drop_cancelled_dequeued",
    "drop_oversized",
    "fail_unreadable",
    "fail_unstarted",
    "give_back_dequeued",
    "give_back_started",
    "record_cancelled_execution",
    "sweep_oversized",
]

log = logging.getLogger("worker.rq")

_WATCH_TRIES = 8  #: optimistic transactions on one job hash before giving up on writing it


def give_back_dequeued(job: Job, queue: Queue) -> None:
    """Return a job this worker dequeued (it sits in RQ's intermediate list) to the front of its queue, in
    one transaction (a crash in between can neither lose it nor leave it in both lists)."""
    with job.connection.pipeline() as pipe:
        pipe.multi()
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        queue.enqueue_job(job, pipeline=pipe, at_front=True)
        pipe.execute()
    log.warning("job %s given back to queue %s untouched", job.id, queue.name)


def give_back_started(worker: Any, job: Job, queue: Queue) -> None:
    """Return a job whose execution was prepared (started registry) but never ran to its queue's front."""
    with job.connection.pipeline() as pipe:
        pipe.multi()
        worker.cleanup_execution(job, pipeline=pipe)
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        queue.enqueue_job(job, pipeline=pipe, at_front=True)
        pipe.execute()
    log.warning("job %s given back to queue %s untouched", job.id, queue.name)


def fail_unreadable(
    connection: Any,
    job_id: str,
    queue: Queue | None,
    exc: BaseException,
    failure_ttl: int,
    *,
    delete_first: bool = False,
) -> None:
    """Mark a dequeued job that RQ cannot load as failed (it was already popped from its queue); with
    `delete_first`, its hash is replaced by that record in the same transaction."""
    message = f"unreadable job hash: {type(exc).__name__}: {exc}"[:2000]
    with connection.pipeline() as pipe:
        if delete_first:
            pipe.delete(Job.key_for(job_id))
        pipe.hset(Job.key_for(job_id), mapping={"status": "failed", "ended_at": utcformat(now()), "exc_info": message})
        pipe.expire(Job.key_for(job_id), failure_ttl)
        if queue is not None:
            pipe.zadd(queue.failed_job_registry.key, {job_id: time.time() + failure_ttl})
            # RQ moved it to the intermediate list on dequeue; its cleanup would fetch it and crash again
            pipe.lrem(queue.intermediate_queue_key, 0, job_id)
        pipe.execute()
    log.error("job %s failed without running: %s", job_id, message)


def drop_oversized(
    connection: Any, job_id: str, exc: BaseException, failure_ttl: int, queue: Queue | None = None
) -> None:
    """A job hash bigger than any job of this service (`OversizedJob`): replaced by
    the failure record of an unreadable one in one transaction, so a client never finds the id without a hash.
    A Redis out of memory refuses that whole transaction (its HSET may grow memory): then the hash is deleted
    first (DEL needs no memory) and the record written after."""
    try:
        fail_unreadable(connection, job_id, queue, exc, failure_ttl, delete_first=True)
    except redis.exceptions.ResponseError:
        connection.delete(Job.key_for(job_id))
        fail_unreadable(connection, job_id, queue, exc, failure_ttl)


def sweep_oversized(connection: Any, cap: int, failure_ttl: int) -> int:
    """Drop every job hash over `cap` bytes in Redis, queued or not (a tenant filling Redis through her own
    job hashes; run while Redis is out of memory: SCAN, MEMORY USAGE and DEL need none). Returns how many."""
    dropped = 0
    for key in connection.scan_iter(match=f"{Job.redis_job_namespace_prefix}*", count=1000, _type="HASH"):
        size = connection.memory_usage(key, samples=0)
        if size is not None and size > cap:
            job_id = key.decode(errors="replace").removeprefix(Job.redis_job_namespace_prefix)
            drop_oversized(connection, job_id, OversizedJob(job_id, int(size), cap), failure_ttl)
            dropped += 1
    if dropped:
        log.warning("dropped %d job hash(es) over %d bytes to give Redis its memory back", dropped, cap)
    return dropped


def fail_unstarted(job: Job, message: str, ttl: int, worker_name: str) -> None:
    """Mark a job that never started as failed as RQ would have: status, `ended_at`, the failed registry of
    its queue, a failure result, the hash's expiry (admission refused it: `worker.jobs.admission`). The job is no
    longer in any queue list (the refusal took it out); it may still be in an intermediate list."""
    queue = Queue(job.origin, connection=job.connection, serializer=job.serializer)
    with job.connection.pipeline() as pipe:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        job.ended_at = now()
        pipe.hset(job.key, mapping={"ended_at": utcformat(job.ended_at), "retries_left": 0})
        pipe.lrem(queue.intermediate_queue_key, 0, job.id)
        queue.failed_job_registry.add(job, ttl=ttl, exc_string=message, pipeline=pipe)
        Result.create_failure(job, ttl, exc_string=message, worker_name=worker_name, pipeline=pipe)
        pipe.expire(job.key, ttl)
        pipe.execute()


def cancel_requested(connection: Any, job: Job) -> bool:
    """True if a client cancelled `job` in Redis: RQ status `canceled`, or the cancel field a client without
    RQ's cancel rights sets (`ltx_contract.control`). One round trip; read fresh, never from the loaded job."""
    status, flag = connection.hmget(job.key, "status", CANCEL_REQUESTED_FIELD)
    return flag is not None or (status is not None and status.decode() == JobStatus.CANCELED.value)


def drop_cancelled_dequeued(job: Job, queue: Queue, ttl: int) -> bool:
    """A job this worker dequeued (RQ's intermediate list) that a client cancelled while it waited: record it
    as RQ records a cancelled queued job (status `canceled`, the canceled registry, the job's expiry) and
    drop it from the intermediate list, in one transaction; it never runs. Returns whether it was recorded.

    The record is written only while the hash is still the submission this worker loaded (WATCH on its
    `created_at`): the client may have deleted the ended job meanwhile (`producer backfill` forgets it to
    enqueue the id again), and a write after that would leave a hash of a few fields that no client can read
    and that blocks the id (a backfill enqueueing it again gives up: "it keeps changing"). Then only the entry
    is dropped."""
    ours = submission_of(job)
    with job.connection.pipeline() as pipe:
        for _ in range(_WATCH_TRIES):
            try:
                pipe.watch(job.key)
                created = pipe.hget(job.key, "created_at")
                if ours is None:  # (a hand-written hash without one: still that hash if it exists without one)
                    same = created is None and bool(pipe.hexists(job.key, "data"))
                else:
                    same = created is not None and created.decode(errors="replace") == ours
                pipe.multi()
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                if same:
                    job.set_status(JobStatus.CANCELED, pipeline=pipe)
                    pipe.hset(job.key, "ended_at", utcformat(now()))
                    CanceledJobRegistry(job.origin, connection=job.connection, serializer=job.serializer).add(
                        job, ttl=ttl, pipeline=pipe
                    )
                    pipe.expire(job.key, ttl)
                pipe.execute()
                return same
            except redis.WatchError:
                continue
    job.connection.lrem(queue.intermediate_queue_key, 1, job.id)  # (the hash keeps changing: not ours to write)
    return False


def record_cancelled_execution(worker: Any, job: Job, ttl: int) -> None:
    """RQ's failure handling records a stopped job as `stopped` *and* adds it to the failed registry with
    a failure result, so `rq info` and registry counts call a cancel a failure. Record it as RQ records a
    cancelled queued job instead: status `canceled`, the canceled registry, no failure result."""
    mark_stopped(worker, None)
    with job.connection.pipeline() as pipe:
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        job.ended_at = now()
        pipe.hset(job.key, "ended_at", utcformat(job.ended_at))
        worker.cleanup_execution(job, pipeline=pipe)
        CanceledJobRegistry(job.origin, connection=job.connection, serializer=job.serializer).add(
            job, ttl=ttl, pipeline=pipe
        )
        pipe.expire(job.key, ttl)
        pipe.execute()
