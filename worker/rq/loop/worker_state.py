"""What RQ's worker keeps private, read and written in one place: the job its stop-job command marked
(`stopped_job_id`, `mark_stopped`), the stop flags and dates (`stop_requested`, `stop_at_first_turn`,
`cold_stop_is_repeat`), its exception handlers, the order it polls its queues in, the stand-in horse a
`SimpleWorker` needs for RQ's kill-horse command to reach it (`FleetHorse`), and its heartbeat on another
connection (`beat`). `tests/test_worker_rqcompat.py` checks each attribute against the installed RQ."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rq.job import Job
from rq.queue import Queue
from rq.utils import now

__all__ = [
    "FleetHorse",
    "beat",
    "cold_stop_is_repeat",
    "exception_handlers",
    "mark_stopped",
    "reorder_polled_queues",
    "stop_at_first_turn",
    "stop_requested",
    "stopped_job_id",
]


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
