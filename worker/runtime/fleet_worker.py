"""`FleetWorker`: the worker process's RQ worker (`worker.rq.loop.worker.RqWorker`, which holds everything that
knows RQ) with the worker's own policy around it: its health snapshot and readiness, what a fleet failure or
change tells operators, the fleet made warm before every dequeue (rebuilt in the background when it died while
idle: `WarmFleet.rebuild_soon`; `FleetUnrecoverable` ends the worker with a non-zero exit code), and the upload
back-pressure (`worker.runtime.backpressure`). The health snapshot is written whenever something in it changes
(`worker.ops.health.HealthPublisher`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ltx_contract.health import FleetHealth, WorkerHealth
from ltx_contract.keys import worker_health_key
from worker.ops.health import HealthPublisher
from worker.render.fleet import FleetUnrecoverable
from worker.render.service import RenderService
from worker.rq.loop.worker import RqWorker
from worker.runtime.backpressure import Backpressure
from worker.runtime.exit_codes import EXIT_FLEET_UNRECOVERABLE

__all__ = ["EXIT_FLEET_UNRECOVERABLE", "FleetWorker"]

log = logging.getLogger("worker.rq")


class FleetWorker(RqWorker):
    """See the module docstring."""

    def __init__(self, queues: Sequence[Any], *, service: RenderService, **kwargs: Any) -> None:
        super().__init__(queues, service=service, **kwargs)
        settings = self.settings
        self.health = HealthPublisher(
            self.side_connection,
            worker_health_key(self.name),
            lambda: self.health_snapshot()[2],
            ttl_s=settings.worker_ttl + 60,
        )
        self.backpressure = Backpressure(service, notify=self.health.notify, tick=self.heartbeat)
        fleet = service.fleet
        fleet.on_failure = self._fleet_failed
        fleet.on_change = self._fleet_changed
        service.pipeline.on_change = self.health.notify
        if settings.tenant_ids and not settings.tenants:
            log.warning(
                "LTX_TENANT_IDS without LTX_TENANTS: tenants' own queues ('<queue>:t:<tenant>', where their "
                "producers submit) are not served by this worker"
            )

    # ==== health ======================================================================================
    def write_health(self) -> None:
        """Publish the health snapshot under `ltx:worker:<name>:health` now (expires with the worker)."""
        self.health.write_now()

    def health_snapshot(self) -> tuple[bool, bool, WorkerHealth]:
        fleet = self.service.fleet
        cur = self.service.current
        live_window = max(self.settings.worker_ttl, 3 * self.settings.heartbeat_interval)
        live = (time.monotonic() - self.last_loop_beat) < live_window + 15 and fleet.state != "stopped"
        fleet_health = FleetHealth(
            fleet.state,
            fleet.is_alive,
            tuple(fleet.pids),
            fleet.world_size,
            tuple(str(d) for d in fleet.devices),
            fleet.builds,
            fleet.rebuilds,
            fleet.failures,
            fleet.ready_at,
            fleet.last_failure,
            fleet.startup,
        )
        uploads = replace(
            self.service.pipeline.snapshot(),
            backpressure=self.backpressure.active,
            backpressure_reason=self.backpressure.why if self.backpressure.active else None,
            background=self.settings.upload_pipeline,
        )
        info = WorkerHealth(
            worker=self.name,
            group=self.service.group,
            queues=tuple(self.queue_names()),
            runner=self.settings.runner,
            limits=self.service.limits.to_json(),  # checked by `producer submit` (ltx_contract.limits)
            loras=self.service.loras.published(),  # catalogue names, S3 prefixes, count (producer.loras)
            fleet=fleet_health,
            current_job=cur.id if cur else None,
            uploads=uploads,
            storage=self.service.storage_state,
            redis=self.redis_outage.snapshot(),
            jobs_done=self.service.jobs_done,
            metrics_port=getattr(self, "metrics_port", None),
            pid=self.pid,
            process_started_at=self.service.process_started_at,
            ts=time.time(),
        )
        return live, self.readiness()[0], info

    def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): the fleet is warm, Redis takes our commands, no back-pressure (then the worker takes
        no job; the reason is also under uploads.backpressure_reason). `/readyz` answers it, and the supervisor's
        `/readyz` too (`worker.runtime.readiness`)."""
        fleet = self.service.fleet
        if not fleet.is_alive:
            return False, f"fleet {fleet.state}"
        if not self.redis_outage.up:
            return False, f"Redis refuses the worker: {self.redis_outage.reason}"
        if self.backpressure.active:
            return False, f"back-pressure: {self.backpressure.why}"
        return True, None

    # ==== the fleet ===================================================================================
    def _fleet_failed(self, info: dict[str, Any]) -> None:
        """The controller's monitor poisoned the fleet (any thread; maybe while idle): say so at once."""
        service = self.service
        service.metrics.fleet_failures.labels(service.group, str(info.get("fleet_reason"))).inc()
        if service.current is None:
            log.warning(
                "fleet died while idle (%s, rank %s exit %s): rebuilding now; no job is taken until it is warm",
                info.get("fleet_reason"),
                info.get("rank"),
                info.get("exitcode"),
            )

    def _fleet_changed(self) -> None:
        fleet = self.service.fleet
        self.service.metrics.set_fleet_state(fleet.state, alive=fleet.is_alive)
        self.health.notify()

    def prepare_fleet(self) -> None:
        """The fleet warm before a dequeue or a job (`WarmFleet.ensure_ready`, RQ's worker key kept alive by
        `tick`); an unrecoverable fleet ends the worker (`SystemExit`), unless a warm stop interrupted the
        rebuild back-off: then the loop stops (`RqWorker._ensure_fleet`)."""
        service = self.service
        try:
            rebuilt = service.fleet.ensure_ready(tick=self.heartbeat)
        except FleetUnrecoverable as exc:
            if self.stop_pending:
                return
            log.critical("%s; the worker exits with code %d", exc, EXIT_FLEET_UNRECOVERABLE)
            service.metrics.fleet_rebuilds.labels(service.group, "failed").inc()
            service.metrics.set_fleet_state("failed", alive=False)
            self.exit_code = EXIT_FLEET_UNRECOVERABLE
            raise SystemExit(EXIT_FLEET_UNRECOVERABLE) from exc
        if rebuilt:
            service.metrics.fleet_rebuilds.labels(service.group, "ok").inc()
