"""Every place the worker reaches into RQ beyond the API a job function sees: registries, job-hash fields,
worker attributes RQ keeps private, and the bookkeeping RQ does not offer (a job that returned before its
upload ended, a job a worker took but never started, a running job a client cancelled).

Written against rq 2.12 and pinned to that minor version (`pyproject.toml`): RQ changes these internals
between minor versions (its main branch already changed `perform_job`'s signature), and
`tests/test_worker_rqcompat.py` checks the signatures and attributes used here against the installed
RQ, so an upgrade fails there rather than in production. Nothing else in `worker/` (or `producer/`)
touches RQ's registries or private state (`test_nothing_but_rqcompat_touches_rq_private_state`): `RenderJob`
and `FleetWorker` override only RQ's public hooks and the ones defined here (`GuardedJob`, `FleetHorse`), and
call these functions. Over 450 lines on purpose: every reach of the worker into RQ's internals in one file is
what makes an RQ upgrade a review of this file and the client's side (`ltx_contract.rq_client`: the bounded
job load, the enqueue without `SADD`, the live workers; its one private call is named by the same test).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import worker_registration
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.registry import clean_registries as clean_queue_registries
from rq.results import Result
from rq.utils import now, utcformat

from ltx_contract.handoff import HandOff
from ltx_contract.keys import CANCEL_REQUESTED_FIELD, REQUEUE_TOKEN_FIELD
from ltx_contract.redis_conn import single_try
from ltx_contract.rq_client import OversizedJob

__all__ = [
    "RQ_MINOR", "STUCK_IN_INTERMEDIATE", "FleetHorse", "GuardedJob", "beat", "cancel_requested",
    "clean_intermediate", "clean_registries", "cold_stop_is_repeat", "drop_cancelled_dequeued",
    "exception_handlers", "fail_after_return", "fail_unreadable", "fail_unstarted",
    "finish_if_uploaded", "give_back_dequeued", "give_back_started", "mark_stopped",
    "record_cancelled_execution", "record_success_after_return", "register_queues", "reorder_polled_queues",
    "requeue_after_return", "set_retry", "stale_intermediate_entry", "started_member_job_id",
    "stop_at_first_turn", "stop_requested", "stopped_job_id",
]  # fmt: skip

log = logging.getLogger("worker.rq")

RQ_MINOR = (2, 12)  #: the RQ minor version this module is written and tested against
STUCK_IN_INTERMEDIATE = "Job was stuck in intermediate queue"  #: RQ's exc_string for that cleanup
_WATCH_TRIES = 8  #: optimistic transactions on one job hash before giving up on writing it


# ==== registry maintenance ================================================================================


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


# ==== queues ================================================================================================


def register_queues(connection: Any, queues: list[Queue]) -> None:
    """Put `queues` in RQ's set of queues (`rq:queues`, what `rq info` and dashboards list)."""
    if queues:
        connection.sadd(Queue.redis_queues_keys, *[q.key for q in queues])


# ==== hooks RQ does not offer ===============================================================================


class GuardedJob(Job):
    """A `Job` that runs `check_runnable()` right before RQ calls its function, inside RQ's execution, so an
    exception there fails the job exactly as one raised by the function would. RQ has no public hook at
    that point: `Job.perform()` calls the private `_execute()`, which is overridden here and nowhere else."""

    def check_runnable(self) -> None:
        """Raise to fail the job without calling its function; the default lets every job run."""

    def _execute(self) -> Any:
        self.check_runnable()
        return super()._execute()


class FleetHorse:
    """Mixin for a `SimpleWorker` whose "horse" is the warm fleet it drives in its own process.

    RQ's kill-horse and stop-job commands (and its cold stop) act only while `horse_pid` is truthy, and a
    `SimpleWorker` reports 0 always. This reports a stand-in (1) while `fleet_busy()` says a job is running,
    so those commands reach the worker's `kill_horse()`; the number is never a process, so the class using
    this must override `kill_horse()` (and `request_force_stop()`) not to signal it."""

    def fleet_busy(self) -> bool:
        raise NotImplementedError

    @property
    def horse_pid(self) -> int:
        return 1 if self.fleet_busy() else 0


def reorder_polled_queues(worker: Any, order: Callable[[list[Queue]], list[Queue]]) -> None:
    """Replace the order `worker` polls its queues in at the next dequeue by `order(current order)`. RQ keeps
    that order in the private `_ordered_queues` and lets a subclass change it only from `reorder_queues`
    (called after each job with the queue the job came from)."""
    worker._ordered_queues = order(worker._ordered_queues)


def started_member_job_id(member: bytes) -> str:
    """The job id of a member of a `StartedJobRegistry` sorted set, read raw (inside a WATCH, where the
    registry's `get_job_ids()` cannot run). RQ 2 writes `<job id>:<execution id>`; a bare id stays as it is."""
    text = member.decode()
    return text.rpartition(":")[0] or text


# ==== worker attributes RQ keeps private =================================================================


def stopped_job_id(worker: Any) -> str | None:
    """The job RQ's stop-job command (or our heartbeat's cancel check) marked as stopped, if any."""
    return getattr(worker, "_stopped_job_id", None)


def mark_stopped(worker: Any, job_id: str | None) -> None:
    """Make RQ's failure handling treat `job_id` as stopped (not failed, not retried); None clears it."""
    worker._stopped_job_id = job_id


def cold_stop_is_repeat(worker: Any, within_s: float = 1.0) -> bool:
    """True when the cold-stop signal arrived within `within_s` of the warm one (one Ctrl+C seen twice)."""
    requested = getattr(worker, "_shutdown_requested_date", None)
    return requested is not None and (now() - requested).total_seconds() < within_s


def stop_requested(worker: Any) -> bool:
    return bool(worker._stop_requested)


def stop_at_first_turn(worker: Any) -> None:
    """Ask RQ's work loop to stop when it first checks for a stop: what a signal between the end of our
    startup and RQ installing its own handlers (after it registers the worker) must do."""
    worker._stop_requested = True


def exception_handlers(worker: Any) -> list[Any]:
    return list(worker._exc_handlers)


def beat(worker: Any, job: Job, connection: Any, ttl: int) -> None:
    """RQ's `maintain_heartbeats` on another connection: refresh the worker key, the execution's deadline in
    the started registry (`ttl` from now) and the job's heartbeat in one round trip. The heartbeat thread
    uses its own connection (with timeouts) so a beat never queues behind the main thread's commands."""
    execution = worker.execution
    if execution is None:
        return
    with connection.pipeline() as pipe:
        worker.heartbeat(ttl + 60, pipeline=pipe)  # first command: the worker hash's HSET
        execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
        job_index = len(pipe)
        job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
        results = pipe.execute()
    # (as RQ does) a HSET that created a key means the key had expired or been deleted meanwhile
    if results[job_index] == 1:
        connection.delete(job.key)
    if results[0] == 1:
        connection.hset(worker.key, mapping=worker.serialize())


# ==== the job hash ========================================================================================


def submission_of(job: Job) -> str | None:
    """Which submission a job hash is: its RQ `created_at` (set when the job is created, kept by re-queues
    and retries; a new job with a reused id gets its own). None when the hash has none."""
    created = getattr(job, "created_at", None)
    return utcformat(created) if created is not None else None


def set_retry(job: Job, retry: bool) -> None:
    """Decide whether RQ re-queues the job when it handles this failure (its `retries_left` on the job
    object, which RQ's failure handling and abandoned-job cleanup read; at once, never scheduled)."""
    job.retries_left = 1 if retry else 0
    job.retry_intervals = None


# ==== jobs taken but never started ========================================================================


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


def fail_unreadable(connection: Any, job_id: str, queue: Queue | None, exc: BaseException, failure_ttl: int,
                    *, delete_first: bool = False) -> None:  # fmt: skip
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


def drop_oversized(connection: Any, job_id: str, exc: BaseException, failure_ttl: int, queue: Queue | None = None
                   ) -> None:  # fmt: skip
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


# ==== a job a client cancelled ==============================================================================


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


# ==== jobs that returned before their upload ended (the background uploader) =============================


def _registries(job: Job) -> tuple[Queue, FinishedJobRegistry, FailedJobRegistry]:
    kw = {"connection": job.connection, "serializer": job.serializer}
    return Queue(job.origin, **kw), FinishedJobRegistry(job.origin, **kw), FailedJobRegistry(job.origin, **kw)


def record_success_after_return(job: Job, result: dict[str, Any], ttl: int, worker_name: str, *,
                                recovered: bool) -> None:  # fmt: skip
    """Record the full result as the job's RQ result, in place of the hand-off value (so `latest_result()`,
    `return_value()` and `results()` look as if the job had returned it); a recovered job whose RQ status
    is not `finished` (failed, or waiting for a retry) is moved there."""
    if not job.connection.exists(job.key):
        log.info("job %s expired before its upload ended; result not recorded in RQ", job.id)
        return
    status = job.get_status(refresh=True)
    recorded = _uploaded_result_exists(job, result)
    # Sent once (`redis_conn.single_try`): redis-py would re-send the whole MULTI after a reply lost in a Redis
    # restart and add a second result; the caller retries this call, and the check above sees the first.
    with single_try(job.connection).pipeline() as pipe:
        if not recorded:  # (a spool recovery after a crash between this and the `uploaded` state: once only)
            _drop_handoff(job, pipe)
            Result.create(job, Result.Type.SUCCESSFUL, ttl, return_value=result, worker_name=worker_name,
                          pipeline=pipe)  # fmt: skip
        if recovered and status != JobStatus.FINISHED:
            # (`started` too: the worker died between `rendered` and RQ's own bookkeeping, so the job is
            # still in the started registry; left there, RQ's abandoned-job cleanup would later mark the
            # uploaded job failed. We hold the spool entry's lock, so no live execution owns the job.)
            _move_to_finished(job, ttl, pipe)
        if ttl > 0:
            pipe.expire(job.key, ttl)
        pipe.execute()


def finish_if_uploaded(job: Job, ttl: int, *, uploaded_state: str) -> bool:
    """Move a job whose meta says `uploaded_state` back to RQ `finished` (and drop the failure result) if
    RQ's abandoned-job cleanup marked it `failed`; True if it did. A worker SIGKILLed before RQ's bookkeeping
    leaves its job in the started registry: its restart uploads the spooled render and finishes the job
    while another worker's cleanup, which read the entry just before, writes `failed`. Neither write sees
    the other, so both check after writing."""
    try:
        job.refresh()
    except Exception:  # (gone or unreadable: nothing to repair)
        return False
    meta = job.meta if isinstance(job.meta, dict) else {}
    if meta.get("state") != uploaded_state or job.get_status(refresh=False) == JobStatus.FINISHED:
        return False
    with job.connection.pipeline() as pipe:
        _move_to_finished(job, ttl, pipe)
        for previous in job.results():
            if previous.type == Result.Type.FAILED and "AbandonedJobError" in str(previous.exc_string or ""):
                pipe.xdel(Result.get_key(job.id), previous.id)
        if ttl > 0:
            pipe.expire(job.key, ttl)
        pipe.execute()
    log.warning("job %s: uploaded, but RQ's abandoned-job cleanup had marked it failed; moved to finished", job.id)
    return True


def _move_to_finished(job: Job, ttl: int, pipe: Any) -> None:
    """Queue pipeline commands that make `job` finished in every RQ structure (status and registries)."""
    queue, finished, failed = _registries(job)
    _remove_started(job, StartedJobRegistry(job.origin, connection=job.connection), pipe)
    pipe.lrem(queue.key, 0, job.id)
    failed.remove(job, pipeline=pipe)
    finished.add(job, ttl, pipeline=pipe)
    job.set_status(JobStatus.FINISHED, pipeline=pipe)


def requeue_after_return(job: Job, token: str) -> None:
    """Put a job RQ saw finish (it returned at `rendered`) back on its queue for another attempt: one
    transaction (registries, expiry, status, the queue entry), so a crash leaves it either finished or queued.

    Idempotent per `token` (one per decision to re-queue; the caller retries with the same one): sent once
    (`single_try`: redis-py re-sends a whole MULTI after a reply lost in a Redis restart, which pushed the
    id twice, and two idle workers could each take an entry), and a retry that finds `token` in the hash
    knows the first try went through, whatever happened to the job since."""
    if job.connection.hget(job.key, REQUEUE_TOKEN_FIELD) == token.encode():
        return
    queue, finished, failed = _registries(job)
    set_retry(job, False)
    with single_try(job.connection).pipeline() as pipe:
        pipe.multi()  # (explicitly: RQ's enqueue_job calls multi() on a pipeline that is not yet in one)
        _drop_handoff(job, pipe)
        finished.remove(job, pipeline=pipe)
        failed.remove(job, pipeline=pipe)
        pipe.persist(job.key)
        pipe.hset(job.key, REQUEUE_TOKEN_FIELD, token)
        queue.enqueue_job(job, pipeline=pipe)
        pipe.execute()


def fail_after_return(job: Job, message: str, ttl: int, worker_name: str) -> None:
    """Mark a job RQ saw finish as failed (status, failed registry, a failure result)."""
    _, finished, failed = _registries(job)
    with job.connection.pipeline() as pipe:
        _drop_handoff(job, pipe)
        finished.remove(job, pipeline=pipe)
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        set_retry(job, False)
        pipe.hset(job.key, "retries_left", 0)
        failed.add(job, ttl=ttl, exc_string=message, pipeline=pipe)
        Result.create_failure(job, ttl, exc_string=message, worker_name=worker_name, pipeline=pipe)
        pipe.expire(job.key, ttl)
        pipe.execute()


def _remove_started(job: Job, registry: StartedJobRegistry, pipe: Any) -> None:
    """Take every execution of `job` out of RQ's started registry (entries are `<job_id>:<execution_id>`;
    read from the registry itself, since a dead worker's execution records may have expired)."""
    prefix = f"{job.id}:".encode()
    entries = [e for e in job.connection.zrange(registry.key, 0, -1) if e.startswith(prefix) or e == job.id.encode()]
    if entries:
        pipe.zrem(registry.key, *entries)


def _uploaded_result_exists(job: Job, result: dict[str, Any]) -> bool:
    """True if RQ already holds a successful `uploaded` result for the same object (one per upload)."""
    for previous in job.results():
        value = previous.return_value
        if (previous.type == Result.Type.SUCCESSFUL and isinstance(value, dict)
                and value.get("state") == "uploaded" and value.get("key") == result.get("key")):  # fmt: skip
            return True
    return False


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


def _drop_handoff(job: Job, pipe: Any) -> None:
    """Delete the hand-off value RQ stored as this execution's result: it stood in while the upload ran
    and is replaced by the real outcome (one result per execution, as without the pipeline)."""
    latest = job.latest_result()
    if latest is not None and HandOff.read(latest.return_value) is not None:
        pipe.xdel(Result.get_key(job.id), latest.id)
