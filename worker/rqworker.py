"""`FleetWorker`: an RQ `SimpleWorker` that runs jobs in-process next to its warm fleet.

Why each override exists (measured behaviours, shared/reference/ecosystem.md §1):
- `SimpleWorker`, never the forking `Worker`: the fleet's IPC handles and CUDA state cannot cross a fork,
  and the model must stay loaded between jobs.
- JSON serializer: no pickle crosses Redis (job args, meta and results are JSON).
- Heartbeat thread during a job: SimpleWorker never refreshes its heartbeat while a job runs, so a long
  render would look abandoned and could be run twice. The thread refreshes the worker key, the
  execution's deadline in `rq:wip:<queue>` and the job heartbeat every `heartbeat_interval`, with a short
  deadline (`job_heartbeat_ttl`) so a *dead* worker's job is detected quickly. It stops in
  `handle_execution_ended`, before RQ removes the execution, so a late beat can never re-add a finished
  job to the started registry.
- `kill_horse()`: RQ's stop-job command lands here (on the pubsub thread) and would be a no-op for a
  SimpleWorker; it cancels the running render cooperatively instead, so the fleet survives and RQ
  records the job as `stopped`. A client's `job.cancel()` on a *running* job is noticed by the heartbeat
  thread and handled the same way.
- Warm stop (first SIGTERM/SIGINT): RQ finishes the job, then the loop ends and `teardown()` stops the
  fleet. Cold stop (second signal): the fleet is killed from a helper thread (never from inside the
  signal handler, which may have interrupted the controller) and `SystemExit` aborts the job, which is
  re-queued per `retry_worker_shutdown`.
- Before every dequeue the fleet is rebuilt if it is poisoned, so a job is never taken by a worker
  without a live fleet; `FleetUnrecoverable` ends the worker with a non-zero exit code.
- Back-pressure: before every dequeue the worker waits while the background uploader (`worker.pipeline`)
  is at its bound of pending uploads; after every job it tells the service that RQ's bookkeeping of the
  return is done (`job_returned`), so the uploader's `uploaded` record always lands after RQ's own.
  `teardown()` drains pending uploads on a warm stop (bounded), never on a cold one.
- Abandoned jobs found by RQ's registry cleanup get a terminal (or retrying) `worker_lost` state event,
  so a client watching the stream learns the outcome even though the worker that ran it is gone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from rq.exceptions import AbandonedJobError, StopRequested
from rq.job import JobStatus
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from .fleet import FleetUnrecoverable
from .keys import FailureReason, JobState, worker_health_key
from .logs import bind_job
from .relay import EventRelay
from .renderjob import RefusedJob, RenderJob, fail_unreadable
from .service import RenderService

__all__ = ["EXIT_FLEET_UNRECOVERABLE", "FleetWorker"]

log = logging.getLogger("worker.rq")

EXIT_FLEET_UNRECOVERABLE = 3
_STUCK_IN_INTERMEDIATE = "Job was stuck in intermediate queue"  # RQ's exc_string for it
# states in which a job's render is complete (its video is committed to a spool, or already in storage)
_RENDER_COMPLETE = frozenset({JobState.RENDERED.value, JobState.UPLOADING.value, JobState.UPLOADED.value})


class FleetWorker(SimpleWorker):
    """See the module docstring."""

    def __init__(self, queues: Any, *, service: RenderService, **kwargs: Any) -> None:
        settings = service.settings
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", RenderJob)  # runs only the render function; survives hostile hashes
        kwargs.setdefault("default_result_ttl", settings.result_ttl)
        kwargs.setdefault("worker_ttl", settings.worker_ttl)
        kwargs.setdefault("maintenance_interval", settings.maintenance_interval)
        kwargs.setdefault("job_monitoring_interval", max(1, int(settings.heartbeat_interval)))
        kwargs.setdefault("name", service.worker_name)
        super().__init__(queues, **kwargs)
        self.service = service
        self.settings = settings
        self.exit_code = 0
        self._beat_stop: threading.Event | None = None
        self._beat_thread: threading.Thread | None = None
        self._cold = False
        self._rebuilding = False  # True while _ensure_fleet runs in the main thread
        self._stop_pending = False  # a warm stop arrived during a rebuild
        self._backpressure = False  # True while waiting for upload room before a dequeue
        self.last_loop_beat = time.monotonic()
        self.push_exc_handler(self._abandoned_job_handler)

    # ==== heartbeats ==================================================================================
    def get_heartbeat_ttl(self, job: Any) -> int:
        return int(self.settings.job_heartbeat_ttl)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        self.last_loop_beat = time.monotonic()
        if pipeline is None:
            self.write_health()

    def write_health(self) -> None:
        """Publish the health snapshot under `ltx:worker:<name>:health` (expires with the worker)."""
        try:
            _, _, info = self.health_snapshot()
            self.connection.set(
                worker_health_key(self.name), json.dumps(info, default=str), ex=self.settings.worker_ttl + 60
            )
        except StopRequested:
            raise  # RQ's warm stop while idle arrives as this exception, wherever the main thread is
        except Exception:
            log.debug("could not write health key", exc_info=True)

    def health_snapshot(self) -> tuple[bool, bool, dict[str, Any]]:
        fleet = self.service.fleet
        cur = self.service.current
        live_window = max(self.settings.worker_ttl, 3 * self.settings.heartbeat_interval)
        live = (time.monotonic() - self.last_loop_beat) < live_window + 15 and fleet.state != "stopped"
        info = {
            "worker": self.name,
            "group": self.service.group,
            "fleet": {"state": fleet.state, "alive": fleet.is_alive, "pids": fleet.pids,
                      "devices": [str(d) for d in fleet.devices], "builds": fleet.builds,
                      "rebuilds": fleet.rebuilds, "last_failure": fleet.last_failure, "startup": fleet.startup},
            "current_job": cur.job_id if cur else None,
            "uploads": {**self.service.pipeline.snapshot(), "backpressure": self._backpressure,
                        "background": self.settings.upload_pipeline},
            "storage": self.service.storage_state,
            "jobs_done": self.service.jobs_done,
            "metrics_port": getattr(self, "metrics_port", None),
            "pid": self.pid,
            "process_started_at": self.service.process_started_at,
            "ts": time.time(),
        }  # fmt: skip
        return live, fleet.is_alive, info

    def _beat_loop(self, job: Any, stop: threading.Event) -> None:
        interval = self.settings.heartbeat_interval
        while not stop.wait(interval):
            try:
                self.maintain_heartbeats(job)
                self.last_loop_beat = time.monotonic()
                self.write_health()
                status = job.get_status(refresh=True)
                if status == JobStatus.CANCELED:
                    log.info("job %s was cancelled in Redis while running; stopping it", job.id)
                    self._stopped_job_id = job.id
                    self.service.cancel(job.id)
            except Exception:
                log.warning("heartbeat failed", exc_info=True)

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
        self._stopped_job_id = None
        self.prepare_execution(job)
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, args=(job, self._beat_stop), name="ltx-heartbeat", daemon=True
        )
        self._beat_thread.start()
        self.service.metrics.busy.labels(self.service.group).set(1)
        if not self.service.fleet.is_alive:
            # The fleet died while we were blocked waiting for this job (a rank crashed while idle). Rebuild
            # it while the heartbeat holds the job, rather than failing a job that never reached a fleet.
            try:
                self._ensure_fleet()
            except SystemExit:
                self._stop_beats()
                self._give_back(job, queue)
                raise
        try:
            with bind_job(job.id):
                self.perform_job(job, queue)
        finally:
            self._stop_beats()
            self.service.job_returned(job.id)  # RQ's success bookkeeping is done: uploads may record now
            self.service.metrics.busy.labels(self.service.group).set(0)
            if not self.settings.upload_pipeline:
                self.service.update_spool_metrics()  # (the pipeline publishes these from its own thread)
        self.set_state("idle")
        if not self._stop_requested and not self._cold:
            self._ensure_fleet()  # rebuild right away so the next job finds a warm fleet

    def _give_back(self, job: Any, queue: Any) -> None:
        """Return a job this worker took but never started to the front of its queue."""
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.execute()
        queue.enqueue_job(job, at_front=True)
        log.warning("job %s given back to queue %s untouched", job.id, queue.name)

    def handle_execution_ended(self, job: Any, queue: Any, heartbeat_ttl: int) -> None:
        self._stop_beats()
        super().handle_execution_ended(job, queue, heartbeat_ttl)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        self._ensure_fleet()
        self._wait_for_upload_room()
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                # RQ attaches job_id/queue when a dequeued hash cannot be loaded; without this the worker
                # (and its warm fleet) would quit on one malformed job.
                job_id = getattr(exc, "job_id", None)
                if job_id is None:
                    raise
                fail_unreadable(self.connection, job_id, getattr(exc, "queue", None), exc, self.settings.failure_ttl)

    def _wait_for_upload_room(self) -> None:
        """Back-pressure: while the background uploader holds `max_pending_uploads` renders (or
        `max_pending_bytes`), take no job. The worker stays registered (heartbeats), idle (a warm stop
        interrupts the wait like an idle dequeue) and says so in metrics, health and the log."""
        pipeline = self.service.pipeline
        if not pipeline.full():
            return
        metrics, group = self.service.metrics, self.service.group
        self._backpressure = True
        metrics.backpressure.labels(group).set(1)
        t0 = last = time.monotonic()
        log.warning("back-pressure: %s; waiting for uploads before taking another job", pipeline.snapshot())
        self.write_health()
        try:
            beat = max(1.0, min(10.0, self.settings.worker_ttl / 4))
            while not pipeline.wait_for_room(beat):
                now = time.monotonic()
                metrics.backpressure_seconds.labels(group).inc(now - last)
                last = now
                self.heartbeat()  # keeps the registration and the health key fresh
        finally:
            metrics.backpressure_seconds.labels(group).inc(time.monotonic() - last)
            metrics.backpressure.labels(group).set(0)
            self._backpressure = False
        log.info("back-pressure released after %.2fs", time.monotonic() - t0)

    def _ensure_fleet(self) -> None:
        service = self.service
        self._rebuilding = True
        beats = self._beat_while_rebuilding() if not service.fleet.is_alive else None
        try:
            rebuilt = service.fleet.ensure_ready()
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
        service.metrics.set_fleet_state(service.fleet.state, alive=service.fleet.is_alive)
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

    def handle_exception(self, job: Any, *exc_info: Any) -> None:
        """Expected outcomes (a failure with a reason, a cancel) get one log line, not a traceback."""
        from .service import JobCancelledByClient, JobFailed

        exc = exc_info[1] if len(exc_info) > 1 else None
        if not isinstance(exc, JobFailed | JobCancelledByClient | AbandonedJobError):
            self._record_unrecorded_failure(job, exc)
        if isinstance(exc, JobFailed | JobCancelledByClient):
            log.info("job %s ended: %s", job.id, exc)
            for handler in self._exc_handlers:
                handler(job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    def _record_unrecorded_failure(self, job: Any, exc: BaseException | None) -> None:
        """A job that failed before the service could record it (a refused function, arguments that do not
        fit `render(request)`) still gets a terminal `failed` state, so watchers never wait forever."""
        try:
            raw = self.connection.hget(job.key, "meta")
            state = json.loads(raw).get("state") if raw else None
            if state in {s.value for s in (JobState.UPLOADED, JobState.FAILED, JobState.CANCELLED, JobState.RETRYING)}:
                return
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return
            # a TypeError before the service started the job: arguments that do not fit render(request)
            refused = isinstance(exc, RefusedJob) or (isinstance(exc, TypeError) and state in (None, "queued"))
            reason = FailureReason.INVALID_REQUEST if refused else FailureReason.INTERNAL
            if not isinstance(job.meta, dict):
                job.meta = {}
            relay = EventRelay(self.connection, job, maxlen=self.settings.events_maxlen, running_ttl=3600)
            error = {"reason": reason.value, "message": f"{type(exc).__name__}: {exc}"[:2000], "retryable": False}
            relay.state(JobState.FAILED, error=error, ttl=int(job.failure_ttl or self.settings.failure_ttl))
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record the failure of job %s", getattr(job, "id", "?"), exc_info=True)

    # ==== cancellation and shutdown ===================================================================
    def kill_horse(self, sig: Any = None) -> None:
        """RQ's stop-job / kill-horse command: cancel the running render cooperatively."""
        job_id = self._stopped_job_id
        if not self.service.cancel(job_id):
            log.info("stop command for %s: no such job running here", job_id)

    @property
    def horse_pid(self) -> int:
        # RQ's kill-horse command only calls kill_horse() when this is truthy; the "horse" is our fleet.
        return 1 if self.service.current is not None else 0

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second signal: kill the fleet (from a helper thread) and abort the running job."""
        if self._shutdown_requested_date is not None:
            from rq.utils import now

            if (now() - self._shutdown_requested_date).total_seconds() < 1:
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
            self.service.metrics.set_fleet_state("stopped", alive=False)
            # Warm stop: let pending uploads finish (bounded); cold: leave them in the spool for the next start.
            drain_s = 0.0 if self._cold else self.settings.upload_drain_timeout_s
            self.service.pipeline.drain(drain_s)
            try:
                self.connection.delete(worker_health_key(self.name))
            except Exception:
                pass

    # ==== jobs dequeued but never started (their worker died in between) ===========================
    def handle_job_failure(self, job: Any, queue: Any, started_job_registry: Any = None, exc_string: str = "") -> Any:
        if exc_string.startswith(_STUCK_IN_INTERMEDIATE):
            self._record_stuck_job(job)
        return super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _record_stuck_job(self, job: Any) -> None:
        """RQ's intermediate-queue cleanup fails a job whose worker died after dequeuing it and before
        starting it, without our retry budget or a state event (found by the chaos suite: a retried job
        stayed `retrying` forever while RQ said failed). Treat it as `worker_lost`: re-queue while that
        budget lasts (RQ retries when `retries_left` > 0), and record the outcome for watchers."""
        try:
            meta = job.meta if isinstance(job.meta, dict) else {}
            job.meta = meta
            retries = dict(meta.get("retries") or {})
            key = FailureReason.WORKER_LOST.value
            retrying = retries.get(key, 0) < self.settings.retry_worker_lost
            error = {"reason": key, "message": "the worker that dequeued this job vanished before starting it",
                     "retryable": retrying}  # fmt: skip
            relay = EventRelay(self.connection, job, maxlen=self.settings.events_maxlen, running_ttl=3600)
            if retrying:
                retries[key] = retries.get(key, 0) + 1
                meta["retries"] = retries
                job.retries_left = 1
                job.retry_intervals = None
                relay.state(JobState.RETRYING, error=error)
            else:
                job.retries_left = 0
                relay.state(JobState.FAILED, error=error, ttl=int(job.failure_ttl or self.settings.failure_ttl))
            log.warning("job %s was dequeued but never started: %s", job.id, "re-queued" if retrying else "failed")
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record stuck job %s", getattr(job, "id", "?"), exc_info=True)

    # ==== abandoned jobs (found by registry cleanup, possibly for another worker's job) ===============
    def _abandoned_job_handler(self, job: Any, exc_type: Any, exc_value: Any, tb: Any) -> bool:
        if exc_type is not AbandonedJobError and not isinstance(exc_value, AbandonedJobError):
            return True
        try:
            meta = job.meta if isinstance(job.meta, dict) else {}
            job.meta = meta
            state = meta.get("state")
            if state in _RENDER_COMPLETE:
                # The render is complete (found by the chaos suite: a worker SIGKILLed between `rendered`
                # and RQ's own bookkeeping left the job in the started registry; its restart recovered the
                # video from the spool and uploaded it, and this cleanup re-queued the job, which rendered
                # and uploaded again: two terminal states). The committed video is in the host's spool
                # (manifest written before `rendered`), and the next worker start there recovers it and
                # records the outcome, moving RQ's status from `failed` to `finished`; an `uploaded` job is
                # done. So: never re-run it (no retry: RQ only marks it failed for now) and write no event.
                job.retries_left = 0
                log.warning("abandoned job %s (worker %s) is already %s: not re-queued; the spool recovery "
                            "uploads/records it", job.id, meta.get("worker"), state)  # fmt: skip
                return True
            retries = dict(meta.get("retries") or {})
            key = FailureReason.WORKER_LOST.value
            retrying = bool(job.retries_left and job.retries_left > 0)
            error = {"reason": key, "message": "the worker running this job vanished (no heartbeat)",
                     "retryable": retrying, "worker": meta.get("worker")}  # fmt: skip
            relay = EventRelay(self.connection, job, maxlen=self.settings.events_maxlen, running_ttl=3600)
            if retrying:
                retries[key] = retries.get(key, 0) + 1
                meta["retries"] = retries
                relay.state(JobState.RETRYING, error=error)
            else:
                relay.state(JobState.FAILED, error=error, ttl=int(job.failure_ttl or self.settings.failure_ttl))
            log.warning("abandoned job %s (worker %s): %s", job.id, meta.get("worker"),
                        "re-queued" if retrying else "failed")  # fmt: skip
        except StopRequested:
            raise
        except Exception:
            log.warning("could not record abandoned job %s", getattr(job, "id", "?"), exc_info=True)
        return True
