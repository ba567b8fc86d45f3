"""Client-side helpers for the service's own semantics (no torch, no fleet): cancelling a job.

Cancellation has two paths because RQ has two: a job still waiting in a queue is cancelled in Redis
(`job.cancel()`: it never runs); a running job is stopped cooperatively by its worker, which receives
RQ's stop-job command, cancels the render at the next denoising step (the fleet survives) and records the
job as `stopped` with a `cancelled` state event.
"""

from __future__ import annotations

from typing import Any

from rq.command import send_stop_job_command
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from .keys import JobState
from .relay import EventRelay

__all__ = ["cancel_job"]


def cancel_job(connection: Any, job_id: str) -> str:
    """Cancel `job_id`. Returns what happened: "cancelled" (was waiting), "stopping" (running; the worker
    stops it), or "finished" (too late: it already ended)."""
    job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    status = job.get_status(refresh=True)
    if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        job.cancel()
        # No worker will ever touch this job: announce the terminal state for stream watchers ourselves.
        ttl = int(job.failure_ttl or 7 * 86400)
        EventRelay(connection, job, maxlen=1000, running_ttl=ttl).state(JobState.CANCELLED, ttl=ttl, queued=True)
        return "cancelled"
    if status == JobStatus.STARTED:
        send_stop_job_command(connection, job_id, serializer=JSONSerializer)
        return "stopping"
    return "finished"
