"""`FleetWorker`: an RQ `SimpleWorker` that runs jobs in-process next to its warm fleet.

Why each override exists (measured behaviours of rq 2.12). Everything that reaches
into RQ's registries or private state lives in `worker.protocol.rqcompat`; how a job's attempt ends is decided and
recorded by `worker.jobs.outcomes`.
- `SimpleWorker`, never the forking `Worker`: the fleet's IPC handles and CUDA state cannot cross a fork,
  and the model must stay loaded between jobs.
- JSON serializer: no pickle crosses Redis (job args, meta and results are JSON).
- Heartbeat thread during a job: SimpleWorker never refreshes its heartbeat while a job runs, so a long
  render would look abandoned and could be run twice. The thread refreshes the worker key, the
  execution's deadline in `rq:wip:<queue>` and the job heartbeat every `heartbeat_interval` on a Redis
  connection of its own (with timeouts, so it never waits behind the main thread or on a dead socket),
  retrying a failed beat after 0.5 s. The deadline is `job_heartbeat_ttl`, at least three intervals (the
  settings check it). It stops in `handle_execution_ended`, before RQ removes the execution, so a late beat
  can never re-add a finished job to the started registry.
- `handle_payload()`: RQ's pubsub `shutdown` command is refused (anyone who can PUBLISH could stop the
  service); `stop-job`/`kill-horse` pass on.
- `kill_horse()`: RQ's stop-job command lands here (on the pubsub thread) and would be a no-op for a
  SimpleWorker; it cancels the running render cooperatively instead, so the fleet survives. A client's
  `job.cancel()` on a *running* job is noticed by the heartbeat thread and handled the same way, and so
  is the cancel field a client without `PUBLISH` rights sets (a tenant's Redis user: `worker.protocol.control`); a
  job that carries it when dequeued is recorded `cancelled` and never runs (`_skip_cancelled`). RQ would
  then record the job `stopped` in its *failed* registry; `handle_job_failure` records it `canceled` in
  the canceled registry instead (a cancel is not a failure).
- Warm stop (first SIGTERM/SIGINT): RQ finishes the job, then the loop ends and `teardown()` stops the
  fleet. Cold stop (second signal): the fleet is killed from a helper thread (never from inside the
  signal handler, which may have interrupted the controller) and `SystemExit` aborts the job, which is
  re-queued per `retry_worker_shutdown`.
- No job is taken without a warm fleet: the dequeue blocks in slices of `_DEQUEUE_SLICE_S` and checks the
  fleet before each; a fleet that died while idle is reported by its controller's monitor at once (metrics,
  health) and rebuilt at once in the background (`WarmFleet.rebuild_soon`); the dequeue waits for
  it, and a job dequeued in the slice during which the fleet died is given back untouched.
  `FleetUnrecoverable` ends the worker with a non-zero exit code.
- Dequeue (`worker.jobs.tenantqueues`): the shared queues and, with `LTX_TENANTS`, every tenant's own queue,
  tenants in turn within a priority (`reorder_queues`); each id is checked (hash, `queued` status, origin,
  tenant) before it counts or runs, junk is dropped at a bounded rate per dequeue, and every taken id sits
  in its queue's intermediate list until it starts (`prepare_job_execution`).
- Admission (`worker.jobs.admission`): before and right after every dequeue the worker ends, without running
  them, the jobs past `LTX_MAX_QUEUE_DEPTH` waiting jobs and past a client's `LTX_CLIENT_QUOTA`
  unfinished jobs, whoever enqueued them (the producer's own check is only the early answer).
- Back-pressure: before every dequeue the worker waits while the background uploader (`worker.render.pipeline`)
  is at its bound of pending uploads, or the spool's disk is nearly full; after every job it tells the
  service that RQ's bookkeeping of the return is done (`job_returned`), so the uploader's `uploaded` record
  always lands after RQ's own.
  `teardown()` drains pending uploads on a warm stop (bounded), never on a cold one.
- Jobs whose worker vanished (found by RQ's abandoned-job or intermediate-queue cleanup, run by any worker
  on the queue) are recorded as `worker_lost` by `worker.jobs.outcomes` with the budget from the settings. The
  cleanup's lock expires after `maintenance_lock_ttl` (RQ's: 15 minutes, so one worker SIGKILLed mid-cleanup
  stopped abandoned-job recovery on the whole queue for that long).
- Health: `worker.ops.health.HealthPublisher` writes the snapshot whenever something in it changes.
- Redis refusing us (out of memory, read-only, loading, unreachable: `worker.protocol.redisoutage`): registration,
  maintenance, the dequeue with its admission, the bookkeeping around a job and heartbeats wait it out with
  back-off and report it (health, `ltx_worker_redis_up`); RQ's work loop would quit on the first one.

Over 450 lines on purpose: one class whose overrides of RQ's hooks share its state (the heartbeat thread,
the stop flags, a rebuild in progress); RQ's internals are in `worker.protocol.rqcompat`, the outcomes in
`worker.jobs.outcomes`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any

import redis
from rq.command import parse_payload
from rq.exceptions import AbandonedJobError, StopRequested
from rq.job import JobStatus
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from worker.jobs.lostpops import LostPops
from worker.jobs.tenantmemory import TenantMemory
from worker.jobs.tenantqueues import TakingQueue, TenantAdmissions, rotate, served_queue_names
from worker.ops.health import HealthPublisher
from worker.ops.logs import bind_job
from worker.protocol import rqcompat
from worker.protocol.health import FleetHealth, WorkerHealth
from worker.protocol.keys import worker_health_key
from worker.protocol.redisoutage import RedisOutage, add_memory_hook, outage_reason, remove_memory_hook
from worker.protocol.renderjob import OversizedJob, RefusedJob, RenderJob
from worker.protocol.states import RECORDED_END_STATES, RENDER_COMPLETE_STATES, TERMINAL_STATES, FailureReason, JobState
from worker.render.fleet import FleetUnrecoverable
from worker.render.service import JobCancelledByClient, JobFailed, RenderService
from worker.runtime.exitcodes import EXIT_FLEET_UNRECOVERABLE

__all__ = ["EXIT_FLEET_UNRECOVERABLE", "FleetWorker"]

log = logging.getLogger("worker.rq")

_DEQUEUE_SLICE_S = 1  # longest a dequeue blocks before the fleet is checked again
_BEAT_RETRY_S = 0.5  # a failed beat is retried this soon (not a whole interval later)
_SPOOL_MIN_FREE_INODES = 16  # a job needs a directory, the video, a manifest and a lock file
_SIDE_TIMEOUT_S = 5.0  # socket timeouts of the heartbeat/health connection
_SWEEP_EVERY_S = 30.0  # while Redis is out of memory, how often job hashes are scanned for oversized ones


class FleetWorker(rqcompat.FleetHorse, SimpleWorker):
    """See the module docstring."""

    def __init__(self, queues: Any, *, service: RenderService, **kwargs: Any) -> None:
        settings = service.settings
        kwargs.setdefault("serializer", JSONSerializer)
        # runs only the render function, within the settings' size limits; survives hostile hashes
        kwargs.setdefault("job_class", RenderJob.with_limits(max_data_bytes=settings.max_request_bytes,
                                                             max_meta_bytes=settings.max_meta_bytes,
                                                             tenant_ids=settings.tenant_ids))  # fmt: skip
        kwargs.setdefault("default_result_ttl", settings.result_ttl)
        kwargs.setdefault("worker_ttl", settings.worker_ttl)
        kwargs.setdefault("maintenance_interval", settings.maintenance_interval)
        kwargs.setdefault("job_monitoring_interval", max(1, int(settings.heartbeat_interval)))
        kwargs.setdefault("name", service.worker_name)
        # checked, bounded dequeues over the shared queues and every tenant's own (worker.jobs.tenantqueues)
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
        self._backpressure = False  # True while waiting for upload room before a dequeue
        self._backpressure_why: str | None = None
        self._complete_abandoned: list[Any] = []  # jobs the last cleanup found complete (see clean_registries)
        self.last_loop_beat = time.monotonic()
        self.redis_outage = RedisOutage(self._redis_changed)
        self._next_sweep = 0.0
        # a per-tenant memory budget and this worker's reserve for recording outcomes (worker.jobs.tenantmemory)
        budget = settings.tenant_redis_bytes if settings.tenant_ids else -1
        self.tenant_memory = TenantMemory(self.connection, worker_name=self.name, tenants=settings.tenants,
                                          budget_bytes=budget, reserve_ttl=2 * max(settings.worker_ttl,
                                          settings.maintenance_interval) + 60,
                                          on_trim=service.metrics.tenant_trimmed)  # fmt: skip
        add_memory_hook(self.tenant_memory.relieve)
        self.side_connection = _side_connection(self.connection)  # heartbeat thread and health writer
        self.health = HealthPublisher(self.side_connection, worker_health_key(self.name),
                                      lambda: self.health_snapshot()[2], ttl_s=settings.worker_ttl + 60)  # fmt: skip
        fleet = service.fleet
        fleet.on_failure = self._fleet_failed
        fleet.on_change = self._fleet_changed
        service.pipeline.on_change = self.health.notify
        self.push_exc_handler(self._abandoned_job_handler)
        self.admission = TenantAdmissions(self.connection, self.queues, depth_cap=settings.depth_cap,
                                          quota=settings.quota, outcomes=self.outcomes, job_class=self.job_class,
                                          worker_name=self.name, max_meta_bytes=settings.max_meta_bytes,
                                          tenant_ids=settings.tenant_ids)  # fmt: skip
        if settings.tenant_ids and not settings.tenants:
            log.warning("LTX_TENANT_IDS without LTX_TENANTS: tenants' own queues ('<queue>:t:<tenant>', where their "
                        "producers submit) are not served by this worker")  # fmt: skip

    def _sweep_lost_pops(self) -> None:
        """`worker.jobs.lostpops`: an outage propagates (waited out, the sweep stays pending); any other Redis
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

    def prepare_job_execution(self, job: Any, remove_from_intermediate_queue: bool = False) -> None:
        """RQ removes the id from the intermediate list only when a worker serves one queue (its multi-queue
        dequeue never put it there); ours always does (worker.jobs.tenantqueues)."""
        super().prepare_job_execution(job, True)

    def reorder_queues(self, reference_queue: Any) -> None:
        """Tenants in turn within each priority (worker.jobs.tenantqueues.rotate)."""
        rqcompat.reorder_polled_queues(self, lambda queues: rotate(queues, reference_queue, lambda q: q.name))

    # ==== health ======================================================================================
    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        try:
            super().heartbeat(timeout, pipeline)
        except Exception as exc:
            if self.redis_outage.refused(exc, "heartbeat") is None:
                raise
        else:
            if pipeline is None:  # (queued on a caller's pipeline: its execute() tells)
                self.redis_outage.cleared()
        self.last_loop_beat = time.monotonic()  # (the loop turns, whether or not Redis took the beat)

    # ==== Redis refusing us (worker.protocol.redisoutage): wait it out, never quit ===============================
    def _wait_out_redis(self, exc: BaseException, where: str) -> bool:
        """If `exc` is a Redis outage: wait its back-off (a stop signal interrupts it) and return True. Out of
        memory, first drop job hashes no job of this service can fill (`sweep_oversized`)."""
        delay = self.redis_outage.refused(exc, where)
        if delay is None:
            return False
        self.last_loop_beat = time.monotonic()
        if isinstance(exc, redis.exceptions.OutOfMemoryError) and time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + _SWEEP_EVERY_S
            try:
                rqcompat.sweep_oversized(self.connection, self.job_class.max_hash_bytes(), self.settings.failure_ttl)
            except Exception:
                log.warning("sweep of oversized job hashes failed", exc_info=True)
        time.sleep(delay)
        return True

    def _redis_changed(self, up: bool) -> None:
        self.service.metrics.redis_up.labels(self.service.group).set(1 if up else 0)
        self.health.notify()

    def register_birth(self) -> None:
        while True:
            try:
                super().register_birth()
                # The queues this worker serves, registered with it (tenants may not: worker.protocol.redisacl),
                # inside the outage handling: a worker started against a Redis over `maxmemory` waits, it does not
                # crash.
                rqcompat.register_queues(self.connection, self.queues)
            except Exception as exc:
                if rqcompat.stop_requested(self):  # (before RQ's loop: a stop signal only sets the flag)
                    raise StopRequested() from exc
                if not self._wait_out_redis(exc, "registration"):
                    raise
                continue
            self.redis_outage.cleared()
            self.tenant_memory.take_reserve()
            return

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ writes the state straight away in `bootstrap` (after `register_birth`): an outage there is waited
        out like the registration's, not a crash (found: a Redis over `maxmemory` at start)."""
        while True:
            try:
                super().set_state(state, pipeline=pipeline)
                return
            except Exception as exc:
                if pipeline is None and rqcompat.stop_requested(self):
                    raise StopRequested() from exc
                if pipeline is not None or not self._wait_out_redis(exc, "state"):
                    raise

    def register_death(self) -> None:
        try:
            super().register_death()
        except Exception as exc:
            if self.redis_outage.refused(exc, "deregistration") is None:
                raise  # (an outage: the registration expires by itself)

    def run_maintenance_tasks(self) -> None:
        self.tenant_memory.maintain()  # (first: what it frees lets the cleanup below record its outcomes)
        try:
            super().run_maintenance_tasks()
        except OversizedJob as exc:  # a hash grown past any job's size after it was taken (RQ's cleanup read it)
            rqcompat.drop_oversized(self.connection, exc.job_id, exc, self.settings.failure_ttl)
        except Exception as exc:
            if self.redis_outage.refused(exc, "maintenance") is None:
                raise

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)
        except Exception as exc:
            if not self._wait_out_redis(exc, "suspension check"):
                raise

    def write_health(self) -> None:
        """Publish the health snapshot under `ltx:worker:<name>:health` now (expires with the worker)."""
        self.health.write_now()

    def health_snapshot(self) -> tuple[bool, bool, WorkerHealth]:
        fleet = self.service.fleet
        cur = self.service.current
        live_window = max(self.settings.worker_ttl, 3 * self.settings.heartbeat_interval)
        live = (time.monotonic() - self.last_loop_beat) < live_window + 15 and fleet.state != "stopped"
        info = WorkerHealth(
            worker=self.name,
            group=self.service.group,
            queues=tuple(self.queue_names()),
            runner=self.settings.runner,
            limits=self.service.limits.to_json(),  # checked by `producer submit` (worker.protocol.limits)
            loras=self.service.loras.published(),  # catalogue names, S3 prefixes, count (producer.loras)
            fleet=FleetHealth(fleet.state, fleet.is_alive, tuple(fleet.pids), fleet.world_size,
                              tuple(str(d) for d in fleet.devices), fleet.builds, fleet.rebuilds, fleet.failures,
                              fleet.ready_at, fleet.last_failure, fleet.startup),
            current_job=cur.job_id if cur else None,
            uploads=replace(self.service.pipeline.snapshot(), backpressure=self._backpressure,
                            backpressure_reason=self._backpressure_why if self._backpressure else None,
                            background=self.settings.upload_pipeline),
            storage=self.service.storage_state,
            redis=self.redis_outage.snapshot(),
            jobs_done=self.service.jobs_done,
            metrics_port=getattr(self, "metrics_port", None),
            pid=self.pid,
            process_started_at=self.service.process_started_at,
            ts=time.time(),
        )  # fmt: skip
        # (in back-pressure the worker takes no job: not ready, with the reason under uploads.backpressure_reason)
        return live, fleet.is_alive and self.redis_outage.up and not self._backpressure, info

    def _fleet_failed(self, info: dict[str, Any]) -> None:
        """The controller's monitor poisoned the fleet (any thread; maybe while idle): say so at once."""
        service = self.service
        service.metrics.fleet_failures.labels(service.group, str(info.get("fleet_reason"))).inc()
        if service.current is None:
            log.warning("fleet died while idle (%s, rank %s exit %s): rebuilding now; no job is taken until it "
                        "is warm", info.get("fleet_reason"), info.get("rank"), info.get("exitcode"))  # fmt: skip

    def _fleet_changed(self) -> None:
        fleet = self.service.fleet
        self.service.metrics.set_fleet_state(fleet.state, alive=fleet.is_alive)
        self.health.notify()

    # ==== heartbeats while a job runs ==================================================================
    def get_heartbeat_ttl(self, job: Any) -> int:
        return int(self.settings.job_heartbeat_ttl)

    def _beat_loop(self, job: Any, stop: threading.Event) -> None:
        interval = self.settings.heartbeat_interval
        ttl = self.get_heartbeat_ttl(job)
        wait = interval
        while not stop.wait(wait):
            try:
                rqcompat.beat(self, job, self.side_connection, ttl)
            except Exception as exc:
                if self.redis_outage.refused(exc, "job heartbeat") is None:  # (an outage is logged once)
                    log.warning("heartbeat failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc,
                                _BEAT_RETRY_S)  # fmt: skip
                wait = _BEAT_RETRY_S
                continue
            self.redis_outage.cleared()
            wait = interval
            self.last_loop_beat = time.monotonic()
            self.health.notify()
            try:
                if rqcompat.cancel_requested(self.side_connection, job):
                    log.info("job %s was cancelled in Redis while running; stopping it", job.id)
                    rqcompat.mark_stopped(self, job.id)
                    self.service.cancel(job.id)
            except Exception:
                log.debug("cancel check failed", exc_info=True)

    def _beat_while_rebuilding(self) -> threading.Event | None:
        """Keep the worker's registration and health key alive while a fleet (re)builds (set the returned
        event to stop). A large model can take longer to load than the registration lives (worker_ttl + 60
        s): RQ's cleanup would then drop the worker from its registry for good, and the health key (with
        the fleet state `starting`) would vanish exactly when an operator looks for it. During a job the
        job's heartbeat thread does this already."""
        if self._beat_thread is not None:
            return None
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.settings.heartbeat_interval):
                try:
                    self.heartbeat()
                except Exception:
                    log.warning("heartbeat during fleet rebuild failed", exc_info=True)

        threading.Thread(target=beat, name="ltx-rebuild-heartbeat", daemon=True).start()
        return stop

    def _stop_beats(self) -> None:
        stop, thread = self._beat_stop, self._beat_thread
        self._beat_stop = self._beat_thread = None
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    # ==== job execution ===============================================================================
    def execute_job(self, job: Any, queue: Any) -> None:
        try:
            self._execute_job(job, queue)
        except Exception as exc:
            if self.redis_outage.refused(exc, f"job {job.id}") is None:
                raise
            self._stop_beats()
            # The job is in RQ's started registry (or still in its queue's intermediate list) with our name;
            # once Redis takes writes again RQ's cleanup finds it and `worker_lost` decides (its budget).
            log.error("job %s: Redis refused its bookkeeping (%s); left for RQ's cleanup of abandoned jobs",
                      job.id, self.redis_outage.reason)  # fmt: skip
            self.set_state("idle")

    def _execute_job(self, job: Any, queue: Any) -> None:
        rqcompat.mark_stopped(self, None)
        self.outcomes.own_limits(job)  # RQ's timeout and the TTLs from the settings, never the enqueuer's
        self.prepare_execution(job)
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, args=(job, self._beat_stop), name="ltx-heartbeat", daemon=True
        )
        self._beat_thread.start()
        self.service.metrics.busy.labels(self.service.group).set(1)
        if not self.service.fleet.is_alive:
            # The fleet died between the dequeue's check and here. Rebuild it while the heartbeat holds the
            # job, rather than failing a job that never reached a fleet.
            try:
                self._ensure_fleet()
            except SystemExit:
                self._stop_beats()
                rqcompat.give_back_started(self, job, queue)
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

    def handle_execution_ended(self, job: Any, queue: Any, heartbeat_ttl: int) -> None:
        self._stop_beats()
        super().handle_execution_ended(job, queue, heartbeat_ttl)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
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

    def _dequeue_slice(self, timeout: int | None, max_idle_time: int | None, idle_deadline: float | None
                       ) -> tuple[bool, Any]:  # fmt: skip
        """One slice of the dequeue: (True, result) to return `result`, (False, None) to look again."""
        self._ensure_fleet()
        self._wait_for_upload_room()
        if self.lost_pops.pending:  # (after a wait that lost its reply: its job back on its queue)
            self._sweep_lost_pops()
        self.admission.before_dequeue(tick=self.heartbeat)  # queue depth and quotas (worker.jobs.admission)
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
            rqcompat.give_back_dequeued(job, queue)
            return False, None
        return self._accept(job, queue), result

    def _accept(self, job: Any, queue: Any) -> bool:
        """Whether a dequeued job runs now: not if a client cancelled it while it waited, nor if it is past
        the depth cap or its client's quota (both end it without running; burst mode included)."""
        if rqcompat.cancel_requested(self.connection, job):
            self._skip_cancelled(job, queue)
            return False
        return self.admission.admit(job, queue, tick=self.heartbeat)

    def _skip_cancelled(self, job: Any, queue: Any) -> None:
        """A client cancelled this job while it waited, through its own hash (a tenant's Redis user cannot
        take it out of the shared queue: `worker.protocol.control`): record it cancelled, never run it."""
        if not rqcompat.drop_cancelled_dequeued(job, queue, self.outcomes.failure_ttl(job)):
            log.info("job %s was cancelled while queued, then deleted or submitted again: entry dropped", job.id)
            return  # (its hash is gone or another submission's: nothing of this one to record)
        meta = job.meta if isinstance(job.meta, dict) else {}
        if meta.get("state") == JobState.CANCELLED.value:  # the client recorded it already
            self.service.metrics.job_outcome("cancelled", "")
        else:
            self.outcomes.cancelled(job, by="client", message="cancelled while queued; skipped when dequeued")
        log.info("job %s was cancelled while queued: skipped", job.id)

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> Any:
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                # RQ attaches job_id/queue when a dequeued hash cannot be loaded; without this the worker
                # (and its warm fleet) would quit on one malformed job.
                job_id = getattr(exc, "job_id", None)
                if job_id is None:
                    raise
                if isinstance(exc, OversizedJob):
                    rqcompat.drop_oversized(self.connection, job_id, exc, self.settings.failure_ttl,
                                            getattr(exc, "queue", None))  # fmt: skip
                    continue
                rqcompat.fail_unreadable(self.connection, job_id, getattr(exc, "queue", None), exc,
                                         self.settings.failure_ttl)  # fmt: skip

    def _wait_for_upload_room(self) -> None:
        """Back-pressure: while the background uploader holds `max_pending_uploads` renders (or
        `max_pending_bytes`), or the spool's disk is nearly full (`spool_min_free_bytes`, or fewer than
        `_SPOOL_MIN_FREE_INODES` inodes: a full spool would fail every job), take no job. The
        worker stays registered (heartbeats), idle (a warm stop interrupts the wait like an idle dequeue)
        and says so in metrics, health (`/readyz` 503, `uploads.backpressure_reason`) and the log. Free space
        is re-checked every second, the LoRA cache yielding its unpinned files to the spool each time, so
        the worker recovers by itself."""
        pipeline = self.service.pipeline
        why = self._backpressure_reason()
        if why is None:
            return
        metrics, group = self.service.metrics, self.service.group
        self._backpressure, self._backpressure_why = True, why
        metrics.backpressure.labels(group).set(1)
        t0 = last = time.monotonic()
        log.warning("back-pressure: %s; waiting before taking another job", why)
        self.health.notify()
        try:
            beat = max(1.0, min(10.0, self.settings.worker_ttl / 4))
            while (still := self._backpressure_reason()) is not None:
                if still != self._backpressure_why:
                    self._backpressure_why = still
                    self.health.notify()
                if pipeline.full():
                    pipeline.wait_for_room(beat)
                else:
                    time.sleep(min(beat, 1.0))  # (disk space comes back through uploads or the operator)
                now = time.monotonic()
                metrics.backpressure_seconds.labels(group).inc(now - last)
                last = now
                self.heartbeat()  # keeps the registration fresh
        finally:
            metrics.backpressure_seconds.labels(group).inc(time.monotonic() - last)
            metrics.backpressure.labels(group).set(0)
            self._backpressure = False
            self.health.notify()
        log.info("back-pressure released after %.2fs", time.monotonic() - t0)

    def _backpressure_reason(self) -> str | None:
        pipeline = self.service.pipeline
        if pipeline.full():
            return f"uploads pending: {pipeline.snapshot()}"
        try:
            free_bytes, free_inodes = self.service.spool.free()
        except OSError as exc:
            return f"spool unusable: {exc}"
        floor = self.settings.spool_min_free_bytes
        if free_bytes < floor and self.service.loras.cache.make_room(floor):
            # (the LoRA cache yields to the spool where they share a disk: evicts unpinned files, then re-checks)
            free_bytes, free_inodes = self.service.spool.free()
        if free_bytes < floor or free_inodes < _SPOOL_MIN_FREE_INODES:
            return f"spool disk nearly full: {free_bytes} bytes, {free_inodes} inodes free"
        return None

    def _ensure_fleet(self) -> None:
        service = self.service
        self._rebuilding = True
        beats = self._beat_while_rebuilding() if not service.fleet.is_alive else None
        try:
            rebuilt = service.fleet.ensure_ready(tick=self.heartbeat)  # (RQ's worker key stays alive meanwhile)
        except FleetUnrecoverable as exc:
            if self._stop_pending:
                raise StopRequested() from exc  # a warm stop interrupted the rebuild back-off
            log.critical("%s; the worker exits with code %d", exc, EXIT_FLEET_UNRECOVERABLE)
            service.metrics.fleet_rebuilds.labels(service.group, "failed").inc()
            service.metrics.set_fleet_state("failed", alive=False)
            self.exit_code = EXIT_FLEET_UNRECOVERABLE
            raise SystemExit(EXIT_FLEET_UNRECOVERABLE) from exc
        finally:
            self._rebuilding = False
            if beats is not None:
                beats.set()
        if rebuilt:
            service.metrics.fleet_rebuilds.labels(service.group, "ok").inc()
        if self._stop_pending:
            raise StopRequested()

    def request_stop(self, signum: int, frame: Any) -> None:
        """First signal (warm stop). While idle RQ raises StopRequested from the handler, i.e. from wherever
        the main thread is; during a fleet rebuild that would be taken for a failed build, so the stop is
        deferred until the rebuild attempt ends (a second signal still aborts at once)."""
        try:
            super().request_stop(signum, frame)
        except StopRequested:
            if not self._rebuilding:
                raise
            self._stop_pending = True
            self.service.fleet.stop_retrying()
            log.info("warm stop requested during a fleet rebuild: stopping once this attempt ends")

    # ==== how an execution ends ==========================================================================
    def handle_exception(self, job: Any, *exc_info: Any) -> None:
        """Expected outcomes (a failure with a reason, a cancel) get one log line, not a traceback."""
        exc = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(exc, JobCancelledByClient):
            rqcompat.mark_stopped(self, job.id)  # however the cancel arrived: RQ must not retry or fail it
        if not isinstance(exc, JobFailed | JobCancelledByClient | AbandonedJobError):
            self._record_unrecorded_failure(job, exc)
        if isinstance(exc, JobFailed | JobCancelledByClient):
            log.info("job %s ended: %s", job.id, exc)
            for handler in rqcompat.exception_handlers(self):
                handler(job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    def handle_job_failure(self, job: Any, queue: Any, started_job_registry: Any = None, exc_string: str = "") -> Any:
        if rqcompat.stopped_job_id(self) == job.id:
            # a cancel, not a failure: `canceled` in RQ's canceled registry (its default: failed registry)
            rqcompat.record_cancelled_execution(self, job, self.outcomes.failure_ttl(job))
            return None
        if exc_string.startswith(rqcompat.STUCK_IN_INTERMEDIATE):
            if rqcompat.stale_intermediate_entry(job, queue):  # RQ drops the entry after this returns
                log.info("job %s: stale intermediate-queue entry dropped (the job is %s)", job.id,
                         job.get_status(refresh=False))  # fmt: skip
                return None
            self._record_lost(job, "the worker that dequeued this job vanished before starting it")
        return super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _record_unrecorded_failure(self, job: Any, exc: BaseException | None) -> None:
        """A job that failed before the service could record it (a refused function, arguments that do not
        fit `render(request)`) still gets a terminal `failed` state, so watchers never wait forever."""
        meta = job.meta if isinstance(job.meta, dict) else {}
        state = meta.get("state")
        if state in RECORDED_END_STATES:
            return  # the service recorded it and set the retry decision
        # Nobody decided: never re-queue on the `retries_left` the job hash came with (a client's or a
        # stale one), even if recording below fails (this path never spent a budget).
        rqcompat.set_retry(job, False)
        try:
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return
            # a TypeError before the service started the job: arguments that do not fit render(request)
            refused = isinstance(exc, RefusedJob) or (isinstance(exc, TypeError) and state in (None, "queued"))
            reason = FailureReason.INVALID_REQUEST if refused else FailureReason.INTERNAL
            self.outcomes.failed(job, reason, f"{type(exc).__name__}: {exc}"[:2000], retryable=False)
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record the failure of job %s", getattr(job, "id", "?"), exc_info=True)

    def _record_lost(self, job: Any, message: str) -> None:
        """The worker running (or holding) `job` vanished: re-queue within the `worker_lost` budget from
        the settings (never from a value the dead execution may not have written), record it either way."""
        try:
            meta = job.meta if isinstance(job.meta, dict) else {}
            worker = meta.get("worker") or job.worker_name or None  # (RQ's field: who dequeued it)
            self.outcomes.failed(job, FailureReason.WORKER_LOST, message, worker=worker)
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record the loss of job %s", getattr(job, "id", "?"), exc_info=True)

    # ==== cancellation and shutdown ===================================================================
    def handle_payload(self, message: Any) -> None:
        """RQ's pubsub commands (`rq:pubsub:<worker>`): `stop-job`/`kill-horse` cancel the running job (what
        any client may do to a job), but `shutdown` is refused: anyone who can PUBLISH on this Redis could
        stop every worker (five in a minute made the supervisor give up). The operator stops a
        worker with a signal. A payload that is not a command is logged and dropped (RQ's own handling ends its
        pubsub thread, and with it cancels of running jobs)."""
        try:
            payload = parse_payload(message)
            command = str(payload.get("command")) if isinstance(payload, dict) else None
        except Exception:
            command = None
        label = command if command in ("shutdown", "stop-job", "kill-horse") else "invalid"
        if label in ("shutdown", "invalid"):
            self.service.metrics.ignored_commands.labels(self.service.group, label).inc()
            log.warning("ignored RQ pubsub command %r on %s (stop workers with SIGTERM; docs/security.md)",
                        command if label != "invalid" else str(message.get("data"))[:80], self.name)  # fmt: skip
            return
        try:
            super().handle_payload(message)
        except Exception:
            log.warning("RQ pubsub command %r failed", command, exc_info=True)

    def kill_horse(self, sig: Any = None) -> None:
        """RQ's stop-job / kill-horse command: cancel the running render cooperatively. RQ sends it for the job
        it has started here, which may not have reached its render yet (RQ marks a job started before it calls
        the job function): the service then remembers the cancel for that job's render."""
        job_id = rqcompat.stopped_job_id(self)
        if self.service.cancel(job_id):
            return
        if job_id is not None and job_id == self.get_current_job_id():
            self.service.cancel_before_start(job_id)
        else:
            log.info("stop command for %s: no such job running here", job_id)

    def fleet_busy(self) -> bool:
        """A render is running (RQ's kill-horse command then reaches `kill_horse`: `rqcompat.FleetHorse`)."""
        return self.service.current is not None

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second signal: kill the fleet (from a helper thread) and abort the running job."""
        if rqcompat.cold_stop_is_repeat(self):
            return  # the same Ctrl+C delivered twice (e.g. supervisor + terminal)
        log.warning("cold shutdown: killing the fleet and aborting the running job")
        self._cold = True
        self.service.stop_uploads.set()
        threading.Thread(target=self.service.fleet.kill, name="ltx-cold-stop", daemon=True).start()
        raise SystemExit(0)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            t0 = time.monotonic()
            self.service.fleet.shutdown(0 if self._cold else None)
            log.info("fleet stopped in %.2fs", time.monotonic() - t0)
            # Warm stop: let pending uploads finish (bounded); cold: leave them in the spool for the next start.
            drain_s = 0.0 if self._cold else self.settings.upload_drain_timeout_s
            self.service.pipeline.drain(drain_s)
            self.health.stop(delete=True)
            remove_memory_hook(self.tenant_memory.relieve)
            with contextlib.suppress(redis.RedisError):
                self.connection.delete(self.tenant_memory.reserve_key)

    # ==== abandoned jobs (found by registry cleanup, possibly for another worker's job) ===============
    def clean_registries(self) -> None:
        """RQ's registry maintenance under a lock that a dead holder keeps for at most three maintenance
        intervals (RQ's keeps it 15 minutes: see `rqcompat.clean_registries`)."""
        self._complete_abandoned = []
        try:
            rqcompat.clean_registries(self, lock_ttl_s=maintenance_lock_ttl(self.settings.maintenance_interval))
        finally:
            self._finish_complete_abandoned()

    def _finish_complete_abandoned(self) -> None:
        """RQ wrote `failed` for each job our handler declined to re-queue (a complete render); a spool
        recovery that recorded `uploaded` meanwhile cannot see that write, so the check after it is ours."""
        for job in self._complete_abandoned:
            with contextlib.suppress(redis.RedisError):
                rqcompat.finish_if_uploaded(job, self.outcomes.result_ttl(job), uploaded_state=JobState.UPLOADED.value)
        self._complete_abandoned = []

    def _abandoned_job_handler(self, job: Any, exc_type: Any, exc_value: Any, tb: Any) -> bool:
        if exc_type is not AbandonedJobError and not isinstance(exc_value, AbandonedJobError):
            return True
        meta = job.meta if isinstance(job.meta, dict) else {}
        state = meta.get("state")
        if state in RENDER_COMPLETE_STATES or state in TERMINAL_STATES:
            # The render is complete (a worker SIGKILLed between `rendered` and RQ's own bookkeeping leaves
            # the job in the started registry; its restart recovers the video from the spool and uploads it,
            # and a re-queue here would render and upload it again: two terminal states). The committed
            # video is in the host's spool and the next worker start there recovers it and records the
            # outcome, moving RQ's status from `failed` to `finished`; an `uploaded` job is done. So: never
            # re-run it and write no event.
            # (`failed`/`cancelled`: the execution recorded its end and vanished before RQ's bookkeeping.)
            rqcompat.set_retry(job, False)
            self._complete_abandoned.append(job)
            log.warning("abandoned job %s (worker %s) is already %s: not re-queued%s", job.id, meta.get("worker"),
                        state, "; the spool recovery uploads/records it" if state in RENDER_COMPLETE_STATES
                        else "")  # fmt: skip
            return True
        self._record_lost(job, "the worker running this job vanished (no heartbeat)")
        return True


def maintenance_lock_ttl(maintenance_interval: int) -> int:
    """Seconds a registry-maintenance lock lives: long enough for any cleanup to finish, short enough that a
    worker killed while holding it delays abandoned-job recovery by little more than its detection."""
    return max(30, 3 * int(maintenance_interval))


def _side_connection(connection: Any) -> Any:
    """A client on the same server as `connection`, with its own pool and short timeouts."""
    pool = connection.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": _SIDE_TIMEOUT_S, "socket_connect_timeout": _SIDE_TIMEOUT_S}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
