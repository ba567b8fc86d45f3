"""Redis refusing the worker (out of memory, read-only, loading, unreachable: `worker.protocol.redis_outage`).

RQ's work loop quits on the first refused command. `OutageTolerantWorker` overrides the hooks where RQ talks to
Redis outside a job (registration, the state write in `bootstrap`, deregistration, maintenance, the suspension
check, the worker heartbeat) so that each waits the outage out with back-off and reports it (health,
`ltx_worker_redis_up`). Out of memory, it first drops job hashes no job of this service can fill
(`unstarted.sweep_oversized`), at most every `_SWEEP_EVERY_S`.
"""

from __future__ import annotations

import logging
import time

import redis
from redis.client import Pipeline
from rq.exceptions import StopRequested
from rq.worker import SimpleWorker

from ltx_contract.rq_client import OversizedJob
from worker.jobs.tenant_memory import TenantMemory
from worker.ops.health import HealthPublisher
from worker.protocol.redis_outage import RedisOutage
from worker.render.service import RenderService
from worker.rq.loop import registries, unstarted, worker_state
from worker.rq.loop.job_class import RenderJob
from worker.settings import WorkerSettings

__all__ = ["OutageTolerantWorker"]

log = logging.getLogger("worker.rq")

_SWEEP_EVERY_S = 30.0  # while Redis is out of memory, how often job hashes are scanned for oversized ones


class OutageTolerantWorker(SimpleWorker):
    """RQ's Redis-facing hooks outside a job, waiting an outage out instead of quitting (module docstring).
    `RqWorker` (and `FleetWorker`) set the attributes below in its `__init__`."""

    service: RenderService
    settings: WorkerSettings
    job_class: type[RenderJob]
    health: HealthPublisher
    tenant_memory: TenantMemory
    redis_outage: RedisOutage
    last_loop_beat: float  #: monotonic time of the loop's last turn (liveness in the health snapshot)
    _next_sweep: float

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        try:
            super().heartbeat(timeout, pipeline)
        except Exception as exc:
            if self.redis_outage.refused(exc, "heartbeat") is None:
                raise
        else:
            if pipeline is None:  # (queued on a caller's pipeline: its execute() tells)
                self.redis_outage.cleared()
        self.last_loop_beat = time.monotonic()  # (the loop turns, whether or not Redis took the beat)

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
                unstarted.sweep_oversized(self.connection, self.job_class.max_hash_bytes(), self.settings.failure_ttl)
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
                # The queues this worker serves, registered with it (tenants may not: ltx_contract.redis_acl),
                # inside the outage handling: a worker started against a Redis over `maxmemory` waits, it does not
                # crash.
                registries.register_queues(self.connection, self.queues)
            except Exception as exc:
                if worker_state.stop_requested(self):  # (before RQ's loop: a stop signal only sets the flag)
                    raise StopRequested() from exc
                if not self._wait_out_redis(exc, "registration"):
                    raise
                continue
            self.redis_outage.cleared()
            self.tenant_memory.take_reserve()
            return

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        """RQ writes the state straight away in `bootstrap` (after `register_birth`): an outage there is waited
        out like the registration's, not a crash (found: a Redis over `maxmemory` at start)."""
        while True:
            try:
                super().set_state(state, pipeline=pipeline)
                return
            except Exception as exc:
                if pipeline is None and worker_state.stop_requested(self):
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
        except OversizedJob as exc:  # a hash grown past any job's size since it was taken
            unstarted.drop_oversized(self.connection, exc.job_id, exc, self.settings.failure_ttl)
        except Exception as exc:
            if self.redis_outage.refused(exc, "maintenance") is None:
                raise

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)
        except Exception as exc:
            if not self._wait_out_redis(exc, "suspension check"):
                raise
