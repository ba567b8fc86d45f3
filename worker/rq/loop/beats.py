"""The job heartbeat thread: RQ's `SimpleWorker` never refreshes its heartbeat while a job runs.

A long render would look abandoned and could be run twice. While a job runs, a thread refreshes the worker
key, the execution's deadline in `rq:wip:<queue>` and the job heartbeat every `heartbeat_interval` on a Redis
connection of its own (`side_connection`, with timeouts, so it never waits behind the main thread or on a
dead socket), retrying a failed beat after `_BEAT_RETRY_S`. The deadline is `job_heartbeat_ttl`, at least
three intervals (the settings check it). The thread stops in `handle_execution_ended`, before RQ removes the
execution, so a late beat can never re-add a finished job to the started registry. Each beat also checks
whether a client cancelled the running job in Redis (`unstarted.cancel_requested`) and cancels its render.
While a fleet (re)builds outside a job, another thread keeps the worker's registration alive
(`_beat_while_rebuilding`).
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from rq.job import Job
from rq.queue import Queue
from rq.worker import SimpleWorker

from worker.ops.health import HealthPublisher
from worker.protocol.redis_outage import RedisOutage
from worker.render.service import RenderService
from worker.rq.loop import unstarted, worker_state
from worker.settings import WorkerSettings

__all__ = ["HeartbeatingWorker", "open_side_connection"]

log = logging.getLogger("worker.rq")

_BEAT_RETRY_S = 0.5  # a failed beat is retried this soon (not a whole interval later)
_SIDE_TIMEOUT_S = 5.0  # socket timeouts of the heartbeat/health connection


class HeartbeatingWorker(SimpleWorker):
    """Heartbeats while a job runs or a fleet rebuilds (module docstring). `RqWorker` sets the attributes
    below in its `__init__`."""

    service: RenderService
    settings: WorkerSettings
    health: HealthPublisher
    redis_outage: RedisOutage
    side_connection: redis.Redis  #: the heartbeat thread's and the health writer's own client
    last_loop_beat: float
    _beat_stop: threading.Event | None
    _beat_thread: threading.Thread | None

    def get_heartbeat_ttl(self, job: Job) -> int:
        return int(self.settings.job_heartbeat_ttl)

    def _start_beats(self, job: Job) -> None:
        """Start the job's heartbeat thread (stopped by `_stop_beats`)."""
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, args=(job, self._beat_stop), name="ltx-heartbeat", daemon=True
        )
        self._beat_thread.start()

    def _beat_loop(self, job: Job, stop: threading.Event) -> None:
        interval = self.settings.heartbeat_interval
        ttl = self.get_heartbeat_ttl(job)
        wait = interval
        while not stop.wait(wait):
            try:
                worker_state.beat(self, job, self.side_connection, ttl)
            except Exception as exc:
                if self.redis_outage.refused(exc, "job heartbeat") is None:  # (an outage is logged once)
                    log.warning("heartbeat failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, _BEAT_RETRY_S)
                wait = _BEAT_RETRY_S
                continue
            self.redis_outage.cleared()
            wait = interval
            self.last_loop_beat = time.monotonic()
            self.health.notify()
            try:
                if unstarted.cancel_requested(self.side_connection, job):
                    log.info("job %s was cancelled in Redis while running; stopping it", job.id)
                    worker_state.mark_stopped(self, job.id)
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

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        self._stop_beats()
        super().handle_execution_ended(job, queue, heartbeat_ttl)


def open_side_connection(connection: redis.Redis) -> redis.Redis:
    """A client on the same server as `connection`, with its own pool and short timeouts."""
    pool = connection.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": _SIDE_TIMEOUT_S, "socket_connect_timeout": _SIDE_TIMEOUT_S}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
