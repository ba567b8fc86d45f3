"""`RqWorker`: RQ's `SimpleWorker` made to run render jobs in-process next to a warm fleet (the RQ half of
`worker.runtime.fleet_worker.FleetWorker`, which adds the worker's health, readiness and fleet policy).

Why it overrides RQ (measured behaviours of rq 2.12). The overrides are grouped by responsibility, one base
class each, all sharing the state `RqWorker.__init__` sets: Redis outages (`outages`), the job heartbeat thread
(`beats`), how an execution ends and abandoned jobs (`endings`), signals, pubsub commands and teardown
(`stops`); what they read or write of RQ's private state is `worker_state`, its registries `registries` and
`unstarted`. How a job's attempt ends is decided and recorded by `worker.jobs.attempt`. This module holds the loop:
- `SimpleWorker`, never the forking `Worker`: the fleet's IPC handles and CUDA state cannot cross a fork,
  and the model must stay loaded between jobs.
- JSON serializer: no pickle crosses Redis (job args, meta and results are JSON); the job class is
  `worker.rq.loop.job_class.RenderJob` with the settings' size limits.
- No job is taken without a warm fleet: the dequeue blocks in slices of `_DEQUEUE_SLICE_S` and asks the
  worker's `prepare_fleet` before each; a job dequeued in the slice during which the fleet died is given back
  untouched, and one whose fleet died before it started waits for the rebuild under its heartbeat.
- Dequeue (`worker.rq.loop.queues`): the shared queues and, with `LTX_TENANTS`, every tenant's own queue,
  tenants in turn within a priority (`reorder_queues`); each id is checked (hash, `queued` status, origin,
  tenant) before it counts or runs, junk is dropped at a bounded rate per dequeue, and every taken id sits
  in its queue's intermediate list until it starts (`prepare_job_execution`).
- Cancel before start: a job a client cancelled while it waited (`ltx_contract.control`: the cancel
  field a tenant's Redis user may set) is recorded `cancelled` when dequeued and never runs (`_skip_cancelled`).
- Admission (`worker.rq.loop.admission`): before and right after every dequeue the worker ends, without running
  them, the jobs past `LTX_MAX_QUEUE_DEPTH` waiting jobs and past a client's `LTX_CLIENT_QUOTA`
  unfinished jobs, whoever enqueued them (the producer's own check is only the early answer).
- Back-pressure (the worker's `backpressure`) before every dequeue; after every job the worker tells the
  service that RQ's bookkeeping of the return is done (`job_returned`), so the uploader's `uploaded` record
  always lands after RQ's own.

What the rest of the worker uses of it (the interface above the wing): `RqWorker(queues, connection=...,
service=...)`, `run()`, `stop_at_first_turn()`, `name`, `pid`, `connection`, `queue_names()`, `heartbeat()`,
and the hooks a subclass defines: `prepare_fleet()` and the `health` and `backpressure` it sets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis
from rq.exceptions import StopRequested
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from ltx_contract.redis_retry import add_memory_hook, outage_reason
from ltx_contract.rq_client import OversizedJob
from ltx_contract.states import JobState
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Cancelled
from worker.jobs.tenant_memory import TenantMemory
from worker.jobs.tenant_queues import rotate, served_queue_names
from worker.ops.health import HealthPublisher
from worker.ops.logs import bind_job
from worker.protocol.redis_outage import RedisOutage
from worker.render.service import RenderService
from worker.rq.loop import unstarted, worker_state
from worker.rq.loop.beats import HeartbeatingWorker, open_side_connection
from worker.rq.loop.endings import EndingWorker
from worker.rq.loop.job_class import RenderJob
from worker.rq.loop.lost_pops import LostPops
from worker.rq.loop.outages import OutageTolerantWorker
from worker.rq.loop.queues import TakingQueue, TenantAdmissions
from worker.rq.loop.stops import StoppingWorker
from worker.rq.record import JobRecord

__all__ = ["RqWorker"]

log = logging.getLogger("worker.rq")

_DEQUEUE_SLICE_S = 1  # longest a dequeue blocks before the fleet is checked again


def _rq_settings(service: RenderService) -> dict[str, Any]:
    """RQ's worker arguments from the worker's settings: JSON only (no pickle crosses Redis), a job class that runs
    only the render function within the settings' size limits and survives hostile hashes, RQ's TTLs and
    intervals, the worker's name."""
    settings = service.settings
    job_class = RenderJob.with_limits(
        max_data_bytes=settings.max_request_bytes,
        max_meta_bytes=settings.max_meta_bytes,
        tenant_ids=settings.tenant_ids,
    )
    return {
        "serializer": JSONSerializer,
        "job_class": job_class,
        "default_result_ttl": settings.result_ttl,
        "worker_ttl": settings.worker_ttl,
        "maintenance_interval": settings.maintenance_interval,
        "job_monitoring_interval": max(1, int(settings.heartbeat_interval)),
        "name": service.worker_name,
    }


def _own_limits(job: Job, limits: dict[str, int]) -> None:
    """Run this execution under the worker's limits (`JobOutcomes.limits`: RQ's timeout, the capped TTLs): on the
    job object (RQ's death penalty and its success/failure handling read them there) and in the hash (the cleanups
    and tools of other processes read them there)."""
    job.timeout, job.result_ttl, job.failure_ttl = limits["timeout"], limits["result_ttl"], limits["failure_ttl"]
    job.connection.hset(job.key, mapping=limits)


class Waits(Protocol):
    """What the loop asks before each dequeue (`worker.runtime.backpressure.Backpressure`)."""

    active: bool

    def wait(self) -> None: ...


class RqWorker(StoppingWorker, EndingWorker, HeartbeatingWorker, OutageTolerantWorker):
    """See the module docstring. A subclass sets `health` and `backpressure` and defines `prepare_fleet`."""

    health: HealthPublisher
    backpressure: Waits

    def __init__(self, queues: Sequence[str | Queue], *, service: RenderService, **kwargs: Any) -> None:
        settings = service.settings
        kwargs = {**_rq_settings(service), **kwargs}
        # checked, bounded dequeues over the shared queues and every tenant's own (worker.rq.loop.queues)
        self.lost_pops = LostPops(settings.tenants)  # (waits whose reply, and the id they took, were lost)
        kwargs.setdefault("queue_class", TakingQueue.with_hook(self._dropped_entry, self.lost_pops))
        if isinstance(queues, list | tuple) and all(isinstance(q, str) for q in queues):
            queues = served_queue_names(queues, settings.tenants)
        super().__init__(queues, **kwargs)
        self.service = service
        self.settings = settings
        self.outcomes = service.outcomes
        self.exit_code = 0
        self._beat_stop: threading.Event | None = None
        self._beat_thread: threading.Thread | None = None
        self._cold = False
        self._rebuilding = False  # True while _ensure_fleet runs in the main thread
        self._stop_pending = False  # a warm stop arrived during a rebuild
        self._complete_abandoned: list[Job] = []  # jobs the last cleanup found complete (see clean_registries)
        self.last_loop_beat = time.monotonic()
        self.redis_outage = RedisOutage(self._redis_changed)
        self._next_sweep = 0.0
        # a per-tenant memory budget and this worker's reserve for recording outcomes (worker.jobs.tenant_memory)
        budget = settings.tenant_redis_bytes if settings.tenant_ids else -1
        reserve_ttl = 2 * max(settings.worker_ttl, settings.maintenance_interval) + 60
        self.tenant_memory = TenantMemory(
            self.connection,
            worker_name=self.name,
            tenants=settings.tenants,
            budget_bytes=budget,
            reserve_ttl=reserve_ttl,
            on_trim=service.metrics.tenant_trimmed,
        )
        add_memory_hook(self.tenant_memory.relieve)
        self.side_connection = open_side_connection(self.connection)  # heartbeat thread and health writer
        self.push_exc_handler(self._abandoned_job_handler)
        self.admission = TenantAdmissions(
            self.connection,
            self.queues,
            depth_cap=settings.depth_cap,
            quota=settings.quota,
            outcomes=self.outcomes,
            job_class=self.job_class,
            worker_name=self.name,
            max_meta_bytes=settings.max_meta_bytes,
            tenant_ids=settings.tenant_ids,
        )

    # ==== the interface above the wing ===================================================================
    def run(self, *, burst: bool = False, max_jobs: int | None = None, logging_level: str = "INFO") -> None:
        """RQ's work loop until it stops (a warm stop, `max_jobs`, a burst's empty queues); a stop requested
        while RQ still registers the worker (outside its loop's own handling) ends it quietly too."""
        try:
            self.work(burst=burst, max_jobs=max_jobs, logging_level=logging_level, with_scheduler=False)
        except StopRequested:
            log.info("stopped before the work loop began")

    def stop_at_first_turn(self) -> None:
        """Stop the loop when it first checks for a stop: what a signal must do between the end of the
        worker's startup and RQ installing its own handlers (after it registers the worker)."""
        worker_state.stop_at_first_turn(self)

    @property
    def stop_pending(self) -> bool:
        """A warm stop arrived during a fleet rebuild: the loop stops once the rebuild attempt ends."""
        return self._stop_pending

    def prepare_fleet(self) -> None:
        """Make the fleet warm before a dequeue or a job (rebuild it if it died); may raise `SystemExit`.
        Defined by the subclass (`FleetWorker`)."""
        raise NotImplementedError

    # ==== the dequeue ===================================================================================
    def _sweep_lost_pops(self) -> None:
        """`worker.rq.loop.lost_pops`: an outage propagates (waited out, the sweep stays pending); any other Redis
        refusal (a user without SCAN) is logged and the sweep given up: never a reason to stop the worker."""
        try:
            requeued = self.lost_pops.sweep(self.connection)
        except redis.exceptions.ResponseError as exc:
            if outage_reason(exc) is not None:
                raise
            log.error("could not look for a job a lost wait took (%s); it may stay queued in no list", exc)
            self.lost_pops.give_up()
            return
        for _ in requeued:
            self.service.metrics.requeued_lost_pops.labels(self.service.group).inc()

    def _dropped_entry(self, queue: str, job_id: str, reason: str) -> None:
        self.service.metrics.dropped_queue_entries.labels(self.service.group, reason).inc()
        log.warning("dropped queue entry %r from %s without counting or running it: %s", job_id, queue, reason)

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """RQ removes the id from the intermediate list only when a worker serves one queue (its multi-queue
        dequeue never put it there); ours always does (worker.rq.loop.queues)."""
        super().prepare_job_execution(job, True)

    def reorder_queues(self, reference_queue: Queue) -> None:
        """Tenants in turn within each priority (worker.jobs.tenant_queues.rotate)."""
        worker_state.reorder_polled_queues(self, lambda queues: rotate(queues, reference_queue, lambda q: q.name))

    # ==== job execution ===============================================================================
    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            self._execute_job(job, queue)
        except Exception as exc:
            if self.redis_outage.refused(exc, f"job {job.id}") is None:
                raise
            self._stop_beats()
            # The job is in RQ's started registry (or still in its queue's intermediate list) with our name;
            # once Redis takes writes again RQ's cleanup finds it and `worker_lost` decides (its budget).
            log.error(
                "job %s: Redis refused its bookkeeping (%s); left for RQ's cleanup of abandoned jobs",
                job.id,
                self.redis_outage.reason,
            )
            self.set_state("idle")

    def _execute_job(self, job: Job, queue: Queue) -> None:
        worker_state.mark_stopped(self, None)
        _own_limits(job, self.outcomes.limits(job.result_ttl, job.failure_ttl))  # (the settings', never the enqueuer's)
        self.prepare_execution(job)
        self._start_beats(job)
        self.service.metrics.busy.labels(self.service.group).set(1)
        if not self.service.fleet.is_alive:
            # The fleet died between the dequeue's check and here. Rebuild it while the heartbeat holds the
            # job, rather than failing a job that never reached a fleet.
            try:
                self._ensure_fleet()
            except SystemExit:
                self._stop_beats()
                unstarted.give_back_started(self, job, queue)
                raise
        try:
            with bind_job(job.id):
                self.health.notify()
                self.perform_job(job, queue)
        finally:
            self._stop_beats()
            self.service.job_returned(job.id)  # RQ's success bookkeeping is done: uploads may record now
            self.service.metrics.busy.labels(self.service.group).set(0)
            if not self.settings.upload_pipeline:
                self.service.update_spool_metrics()  # (the pipeline publishes these from its own thread)
            self.health.notify()
        self.set_state("idle")

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """RQ's dequeue in slices of at most `_DEQUEUE_SLICE_S`, with the fleet checked before each (and the
        upload back-pressure); `timeout`/`max_idle_time` keep RQ's meaning (None: burst, one look)."""
        idle_deadline = None if max_idle_time is None else time.monotonic() + max_idle_time
        while True:
            try:
                done, result = self._dequeue_slice(timeout, max_idle_time, idle_deadline)
            except Exception as exc:
                if not self._wait_out_redis(exc, "dequeue"):
                    raise
                continue
            if done:  # (the outage ends with a write that went through: `heartbeat`, at every slice)
                return result

    def _dequeue_slice(
        self, timeout: int | None, max_idle_time: int | None, idle_deadline: float | None
    ) -> tuple[bool, tuple[Job, Queue] | None]:
        """One slice of the dequeue: (True, result) to return `result`, (False, None) to look again."""
        self._ensure_fleet()
        self.backpressure.wait()
        if self.lost_pops.pending:  # (after a wait that lost its reply: its job back on its queue)
            self._sweep_lost_pops()
        self.admission.before_dequeue(tick=self.heartbeat)  # queue depth and quotas (worker.rq.loop.admission)
        if timeout is None:
            result = self._dequeue(None, max_idle_time)
            return (result is None or self._accept(*result)), result
        slice_s = _DEQUEUE_SLICE_S
        if idle_deadline is not None:
            left = idle_deadline - time.monotonic()
            if left <= 0:
                return True, None
            slice_s = max(1, min(slice_s, int(left)))
        result = self._dequeue(slice_s, slice_s)
        if result is None:
            return False, None
        job, queue = result
        if not self.service.fleet.is_alive:  # it died during this slice: never hold a job without a fleet
            unstarted.give_back_dequeued(job, queue)
            return False, None
        return self._accept(job, queue), result

    def _accept(self, job: Job, queue: Queue) -> bool:
        """Whether a dequeued job runs now: not if a client cancelled it while it waited, nor if it is past
        the depth cap or its client's quota (both end it without running; burst mode included)."""
        if unstarted.cancel_requested(self.connection, job):
            self._skip_cancelled(job, queue)
            return False
        return self.admission.admit(job, queue, tick=self.heartbeat)

    def _skip_cancelled(self, job: Job, queue: Queue) -> None:
        """A client cancelled this job while it waited, through its own hash (a tenant's Redis user cannot
        take it out of the shared queue: `ltx_contract.control`): record it cancelled, never run it."""
        if not unstarted.drop_cancelled_dequeued(job, queue, self.outcomes.failure_ttl(job.failure_ttl)):
            log.info("job %s was cancelled while queued, then deleted or submitted again: entry dropped", job.id)
            return  # (its hash is gone or another submission's: nothing of this one to record)
        meta = job.meta if isinstance(job.meta, dict) else {}
        if meta.get("state") == JobState.CANCELLED.value:  # the client recorded it already
            self.service.metrics.job_outcome("cancelled", "")
        else:
            cancel = Cancelled({"by": "client", "message": "cancelled while queued; skipped when dequeued"})
            JobAttempt(JobRecord(job), self.outcomes).decide(cancel)
        log.info("job %s was cancelled while queued: skipped", job.id)

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> tuple[Job, Queue] | None:
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                # RQ attaches job_id/queue when a dequeued hash cannot be loaded; without this the worker
                # (and its warm fleet) would quit on one malformed job.
                job_id = getattr(exc, "job_id", None)
                if job_id is None:
                    raise
                queue = getattr(exc, "queue", None)
                if isinstance(exc, OversizedJob):
                    unstarted.drop_oversized(self.connection, job_id, exc, self.settings.failure_ttl, queue)
                    continue
                unstarted.fail_unreadable(self.connection, job_id, queue, exc, self.settings.failure_ttl)

    def _ensure_fleet(self) -> None:
        """`prepare_fleet` with the worker's registration kept alive meanwhile; a warm stop that arrived during
        a rebuild stops the loop once the rebuild attempt ends (`stops.StoppingWorker.request_stop`)."""
        self._rebuilding = True
        beats = self._beat_while_rebuilding() if not self.service.fleet.is_alive else None
        try:
            self.prepare_fleet()
        finally:
            self._rebuilding = False
            if beats is not None:
                beats.set()
        if self._stop_pending:
            raise StopRequested()
