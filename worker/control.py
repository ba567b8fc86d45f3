"""Cancelling a job, from any client (the producer CLI and its Python API use this; so can anyone else).

Cancellation has two paths because RQ has two:
- a job still waiting in a queue is cancelled in Redis (RQ's `job.cancel()`: it never runs) and its
  terminal `cancelled` state is written here, since no worker will ever see it; the status check and
  the cancel are one optimistic transaction, so a worker cannot take the job in between;
- a running job is stopped cooperatively by its worker, which receives RQ's stop-job command, cancels
  the render at the next denoising step (the fleet survives) and records it: `cancelled` state event, RQ
  status `canceled` in the canceled registry (`worker.outcomes`, `worker.rqcompat`).

Imports rq and redis but neither torch nor the fleet, so light clients can use it.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation
from rq.job import Job
from rq.serializers import JSONSerializer

from .keys import TERMINAL_STATES, JobState, derive_state
from .relay import EventRelay

__all__ = ["CANCELLED", "STOP_REQUESTED", "cancel_job"]

CANCELLED = "cancelled"  #: it was waiting and will never run
STOP_REQUESTED = "stop_requested"  #: it is running; its worker stops it at the next step
_WAITING = ("queued", "deferred", "scheduled")
_START_WAIT_S = 10.0  # a job between dequeue and start has no worker to tell yet: retry the stop this long


def cancel_job(connection: Any, job_id: str, *, failure_ttl: int = 7 * 86400) -> str:
    """Cancel `job_id`: `CANCELLED`, `STOP_REQUESTED`, or "already_<state>" when it had ended.

    Raises rq's `NoSuchJobError` for an unknown job and redis' connection errors as they come."""
    job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
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
                if status in _WAITING:
                    pipe.multi()
                    job.cancel(pipeline=pipe)
                    pipe.execute()
                    ttl = int(job.failure_ttl or failure_ttl)
                    EventRelay(connection, job, maxlen=1000, running_ttl=ttl).state(
                        JobState.CANCELLED, ttl=ttl, by="client", message="cancelled while queued"
                    )
                    return CANCELLED
                pipe.reset()
                break
            except redis.WatchError:
                continue
    deadline = time.monotonic() + _START_WAIT_S
    while True:
        try:
            send_stop_job_command(connection, job_id, serializer=JSONSerializer)
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


def _meta(raw: bytes | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        meta = JSONSerializer.loads(raw)
    except (ValueError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}
