"""Stopping a worker and cancelling its job: signals, RQ's pubsub commands, teardown.

- `handle_payload()`: RQ's pubsub `shutdown` command is refused (anyone who can PUBLISH could stop the
  service); `stop-job`/`kill-horse` pass on.
- `kill_horse()`: RQ's stop-job command lands here (on the pubsub thread) and would be a no-op for a
  SimpleWorker; it cancels the running render cooperatively instead, so the fleet survives
  (`worker_state.FleetHorse` shows RQ a horse while a render runs).
- Warm stop (first SIGTERM/SIGINT): RQ finishes the job, then the loop ends and `teardown()` stops the
  fleet and drains pending uploads (bounded). A warm stop during a fleet rebuild is deferred until the
  rebuild attempt ends. Cold stop (second signal): the fleet is killed from a helper thread (never from
  inside the signal handler, which may have interrupted the controller) and `SystemExit` aborts the job,
  which is re-queued per `retry_worker_shutdown`; pending uploads stay in the spool for the next start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import FrameType
from typing import Any

import redis
from rq.command import parse_payload
from rq.exceptions import StopRequested
from rq.worker import SimpleWorker

from ltx_contract.redis_retry import remove_memory_hook
from worker.jobs.tenant_memory import TenantMemory
from worker.ops.health import HealthPublisher
from worker.render.service import RenderService
from worker.rq.loop import worker_state
from worker.settings import WorkerSettings

__all__ = ["StoppingWorker"]

log = logging.getLogger("worker.rq")


class StoppingWorker(worker_state.FleetHorse, SimpleWorker):
    """Signals, pubsub commands and teardown (module docstring). `RqWorker` sets the attributes below in
    its `__init__`."""

    service: RenderService
    settings: WorkerSettings
    health: HealthPublisher
    tenant_memory: TenantMemory
    _cold: bool  #: a cold stop arrived: teardown kills the fleet and drains nothing
    _rebuilding: bool  #: a fleet (re)build runs in the main thread
    _stop_pending: bool  #: a warm stop arrived during that rebuild

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
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

    # ==== cancellation and shutdown ===================================================================
    def handle_payload(self, message: dict[str, Any]) -> None:
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
            log.warning(
                "ignored RQ pubsub command %r on %s (stop workers with SIGTERM; docs/security.md)",
                command if label != "invalid" else str(message.get("data"))[:80],
                self.name,
            )
            return
        try:
            super().handle_payload(message)
        except Exception:
            log.warning("RQ pubsub command %r failed", command, exc_info=True)

    def kill_horse(self, sig: int | None = None) -> None:
        """RQ's stop-job / kill-horse command: cancel the running render cooperatively. RQ sends it for the job
        it has started here, which may not have reached its render yet (RQ marks a job started before it calls
        the job function): the service then remembers the cancel for that job's render."""
        job_id = worker_state.stopped_job_id(self)
        if self.service.cancel(job_id):
            return
        if job_id is not None and job_id == self.get_current_job_id():
            self.service.cancel_before_start(job_id)
        else:
            log.info("stop command for %s: no such job running here", job_id)

    def fleet_busy(self) -> bool:
        """A render is running (RQ's kill-horse command then reaches `kill_horse`: `worker_state.FleetHorse`)."""
        return self.service.current is not None

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """Second signal: kill the fleet (from a helper thread) and abort the running job."""
        if worker_state.cold_stop_is_repeat(self):
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
