"""Cancelling a job, from any client (the producer CLI and its Python API use this; so can anyone else).

Cancellation has two paths because RQ has two:
- a job still waiting in a queue is cancelled in Redis (RQ's `job.cancel()`: it never runs) and its
  terminal `cancelled` state is written here, since no worker will ever see it; the status check and
  the cancel are one optimistic transaction, so a worker cannot take the job in between;
- a running job is stopped cooperatively by its worker, which receives RQ's stop-job command, cancels
  the render at the next denoising step (the fleet survives) and records it: `cancelled` state event, RQ
  status `canceled` in the canceled registry (`worker.jobs.outcomes`, `worker.rq.loop.unstarted`).

A tenant's Redis user (`ltx_contract.redis_acl`) may do neither: RQ's cancel removes the id from the shared queue
list and registries, and the stop-job command is a `PUBLISH`. When Redis answers NOPERM the cancel is
written into the job's own hash instead (`CANCEL_REQUESTED_FIELD`, and for a waiting job status
`canceled` plus its `cancelled` state): a worker that dequeues such a job records it cancelled and never
runs it, and a running one stops it at its next heartbeat (`worker.rq.loop.beats`).

Imports rq and redis but neither torch nor the fleet, so light clients can use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from ltx_contract.event_stream import EventWriter
from ltx_contract.keys import CANCEL_REQUESTED_FIELD
from ltx_contract.states import TERMINAL_STATES, JobState, derive_state

__all__ = ["CANCELLED", "STOP_REQUESTED", "cancel_job"]

CANCELLED = "cancelled"  #: it was waiting and will never run
STOP_REQUESTED = "stop_requested"  #: it is running; its worker stops it at the next step
_WAITING = ("queued", "deferred", "scheduled")
_START_WAIT_S = 10.0  # a job between dequeue and start has no worker to tell yet: retry the stop this long


def cancel_job(connection: Any, job_id: str, *, failure_ttl: int = 7 * 86400) -> str:
    """Cancel `job_id`: `CANCELLED`, `STOP_REQUESTED`, or "already_<state>" when it had ended.

    Raises rq's `NoSuchJobError` for an unknown job and redis' connection errors as they come."""
    job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    try:
        return _cancel_through_rq(connection, job, failure_ttl)
    except redis.exceptions.NoPermissionError:  # a tenant's user: no PUBLISH, no shared queue writes
        return _cancel_in_own_hash(connection, job, failure_ttl)


def _cancel_through_rq(connection: Any, job: Job, failure_ttl: int) -> str:
    def write(pipe: Any, status: str | None) -> str | None:
        if status not in _WAITING:
            return None  # running (or between dequeue and start): its worker stops it
        job.cancel(pipeline=pipe)
        return CANCELLED

    answer = _transact(connection, job, write)
    if answer == CANCELLED:
        _record_queued_cancel(connection, job, failure_ttl, "cancelled while queued")
    if answer is not None:
        return answer
    deadline = time.monotonic() + _START_WAIT_S
    while True:
        try:
            send_stop_job_command(connection, job.id, serializer=JSONSerializer)
            return STOP_REQUESTED
        except InvalidJobOperation:
            # Between dequeue and start RQ has no worker to address yet: retry until it starts or ends.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            raw_status, raw_meta = connection.hmget(job.key, "status", "meta")
            state = derive_state(raw_status.decode() if raw_status else None, _meta(raw_meta))
            if state in TERMINAL_STATES:
                return f"already_{state.value}"


def _cancel_in_own_hash(connection: Any, job: Job, failure_ttl: int) -> str:
    """Cancel through the job's own hash only (see the module docstring)."""
    ttl = int(job.failure_ttl or failure_ttl)

    def write(pipe: Any, status: str | None) -> str:
        pipe.hset(job.key, CANCEL_REQUESTED_FIELD, str(time.time()))
        if status not in _WAITING:
            return STOP_REQUESTED  # its worker sees the field at its next heartbeat
        # RQ's own status too: `rq info`, quotas and every reader see it ended
        pipe.hset(job.key, mapping={"status": "canceled", "ended_at": utcformat(now())})
        pipe.expire(job.key, ttl)
        return CANCELLED

    answer = _transact(connection, job, write)
    if answer == CANCELLED:
        _record_queued_cancel(connection, job, failure_ttl, "cancelled while queued (skipped when dequeued)")
    return str(answer)


def _transact(connection: Any, job: Job, write: Callable[[Any, str | None], str | None]) -> str | None:
    """One optimistic transaction on the job's hash: "already_<state>" if the job had ended (nothing
    written), else what `write(pipe, rq_status)` answers after the commands it queued ran atomically (a
    worker taking or ending the job in between makes it start over)."""
    with connection.pipeline() as pipe:
        while True:
            try:
                pipe.watch(job.key)
                raw_status, raw_meta = pipe.hmget(job.key, "status", "meta")
                status = raw_status.decode() if raw_status else None
                state = derive_state(status, _meta(raw_meta))
                if state in TERMINAL_STATES:
                    pipe.reset()
                    return f"already_{state.value}"
                pipe.multi()
                answer = write(pipe, status)
                pipe.execute()
                return answer
            except redis.WatchError:
                continue


def _record_queued_cancel(connection: Any, job: Job, failure_ttl: int, message: str) -> None:
    """The terminal `cancelled` state of a job that never ran (no worker will write it)."""
    ttl = int(job.failure_ttl or failure_ttl)
    EventWriter(connection, job, maxlen=1000, running_ttl=ttl).state(
        JobState.CANCELLED, ttl=ttl, by="client", message=message
    )


def _meta(raw: bytes | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        meta = JSONSerializer.loads(raw)
    except (ValueError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}
