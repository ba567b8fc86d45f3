"""RQ's registry maintenance, run by every worker on its queues: the cleanup that finds jobs whose worker
vanished, with a lock that cannot outlive its holder by long (`clean_registries`), RQ's intermediate-list cleanup
made to survive entries that are no jobs (`clean_intermediate`) and to leave alone a job that moved on
(`stale_intermediate_entry`), the set of served queues (`register_queues`) and the started registry's members
(`started_member_job_id`). The steps are RQ 2.12's own, in its order (`tests/test_worker_rqcompat.py` reads
RQ's source for them)."""

from __future__ import annotations

import contextlib
from typing import Any

import redis
from rq import worker_registration
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries as clean_queue_registries
from rq.utils import now

from worker.rq.loop.unstarted import fail_unreadable
from worker.rq.loop.worker_state import exception_handlers

__all__ = [
    "STUCK_IN_INTERMEDIATE",
    "clean_intermediate",
    "clean_registries",
    "register_queues",
    "stale_intermediate_entry",
    "started_member_job_id",
]

STUCK_IN_INTERMEDIATE = "Job was stuck in intermediate queue"  #: RQ's exc_string for that cleanup


def clean_registries(worker: Any, lock_ttl_s: int) -> None:
    """RQ's `Worker.clean_registries` (the maintenance that finds abandoned jobs) with a maintenance lock
    that expires after `lock_ttl_s` and is released however the cleanup ends.

    RQ takes `rq:clean_registries:<queue>` for 899 s and releases it only when the cleanup returns. A worker
    SIGKILLed while it holds the lock, or a cleanup cut short by a Redis restart (the lock survives in the
    AOF), leaves it held: for 15 minutes no worker on the queue runs the cleanup, so a job whose worker
    vanished stays `rendering` that long. The steps are RQ 2.12's own, in its order."""
    for queue in worker.queues:
        if not queue.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=lock_ttl_s):
            continue  # another worker is cleaning this queue
        try:
            worker.log.info("Worker %s: cleaning registries for queue: %s", worker.name, queue.name)
            clean_queue_registries(queue, exception_handlers(worker))
            worker_registration.clean_worker_registry(queue)
            clean_intermediate(worker, queue)
        finally:
            with contextlib.suppress(redis.RedisError):  # (unreachable Redis: the lock expires on its own)
                queue.release_maintenance_lock()
    worker.last_cleaned_at = now()


def clean_intermediate(worker: Any, queue: Queue) -> None:
    """RQ 2.12's `IntermediateQueue.cleanup` (a job left in the intermediate list by a worker that died between
    taking it and starting it fails as stuck after a minute), tolerating entries that are not jobs.

    RQ's version fetches every entry and raised on the first that is no valid job id, is not UTF-8 or names an
    unreadable hash; the exception ended the worker's loop and the worker quit (the supervisor restarted it: the
    chaos soak, seed 13 under load). Such entries pass through the list by design: a worker moves each id there
    before it checks it (`worker.jobs.tenant_queues`), and a tenant's queue may hold anything. Here an entry that
    can never name a job is dropped; one whose hash cannot be read is left to the worker that took it (it fails
    the job: `fail_unreadable`), or failed the same way once stuck, if that worker died first."""
    from rq.job import validate_job_id

    intermediate = queue.intermediate_queue
    for raw in queue.connection.lrange(intermediate.key, 0, -1):
        try:
            job_id = raw.decode()
            validate_job_id(job_id)
        except (UnicodeDecodeError, ValueError):
            queue.connection.lrem(intermediate.key, 1, raw)
            continue
        if job_id in queue.started_job_registry:
            continue
        try:
            job = queue.fetch_job(job_id)
        except Exception as exc:  # (unreadable: malformed fields, an oversized hash, a foreign serializer)
            if not intermediate.set_first_seen(job_id) and intermediate.should_be_cleaned_up(job_id):
                settings = getattr(worker, "settings", None)
                fail_unreadable(queue.connection, job_id, queue, exc, int(getattr(settings, "failure_ttl", 86400)))
            continue
        if job is None:
            intermediate.remove(job_id)
            continue
        if intermediate.set_first_seen(job_id):
            continue
        if intermediate.should_be_cleaned_up(job_id):
            worker.handle_job_failure(job, queue, exc_string=STUCK_IN_INTERMEDIATE + ".")
            intermediate.remove(job_id)


def stale_intermediate_entry(job: Job, queue: Queue) -> bool:
    """True if a job RQ's intermediate-queue cleanup calls stuck has in fact moved on: it is back in its
    queue, running, or ended. A worker SIGKILLed between taking a job and starting it leaves the id in the
    intermediate list; the abandoned-job cleanup may re-queue the job meanwhile, and RQ's cleanup, finding
    the old entry a minute later, would queue it a second time (and the job would render twice).
    Only a job still `queued` but absent from its queue is really stuck; a job of another queue (an id
    pushed onto this intermediate list by a client, where clients may write it) never is."""
    if job.get_status(refresh=True) != JobStatus.QUEUED or job.origin != queue.name:
        return True
    return job.connection.lpos(queue.key, job.id) is not None


def register_queues(connection: Any, queues: list[Queue]) -> None:
    """Put `queues` in RQ's set of queues (`rq:queues`, what `rq info` and dashboards list)."""
    if queues:
        connection.sadd(Queue.redis_queues_keys, *[q.key for q in queues])


def started_member_job_id(member: bytes) -> str:
    """The job id of a member of a `StartedJobRegistry` sorted set, read raw (inside a WATCH, where the
    registry's `get_job_ids()` cannot run). RQ 2 writes `<job id>:<execution id>`; a bare id stays as it is."""
    text = member.decode()
    return text.rpartition(":")[0] or text
