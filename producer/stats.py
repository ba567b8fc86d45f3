"""`StatsQueries`: the client's `stats`: queue and registry counts, live workers with their health
snapshot, the caller's recent failures and its admission usage. Reads only: it never triggers RQ's
registry maintenance."""

from __future__ import annotations

from typing import Any

from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from ltx_contract.health import SnapshotError, read_health
from ltx_contract.keys import base_queue, queue_tenant, tenant_queue, worker_health_key
from ltx_contract.rq_client import live_workers
from producer.admission import TERMINAL_STATUSES, client_key
from producer.models import (
    FailureInfo,
    JobNotFound,
    JobUnreadable,
    QueueStats,
    Stats,
    WorkerInfo,
    unavailable_on_error,
)


class StatsQueries:
    """Mixed into `ProducerClient` (uses its `settings`, `connection`, `_read`, `_visible`, `_may_read`;
    `queue` and `view_queues`, the queue layout a client sees, serve its `submit` and `ls` too)."""

    # ---- stats -------------------------------------------------------------------------------------
    def queue(self, name: str | None = None) -> Any:
        """The RQ queue this client writes and reads for `name` (default: the first of `LTX_QUEUES`): a
        tenant's own `<name>:t:<client>` (the only queue its Redis user may push to, and the only one whose
        depth counts against it: `worker.jobs.tenant_queues`), the shared queue otherwise."""
        name = name or self.settings.default_queue
        if self.settings.tenant_ids and not self.settings.operator:
            name = tenant_queue(name, self.settings.client)
        return Queue(name, connection=self.connection, serializer=JSONSerializer)

    def view_queues(self, names: list[str]) -> list[Any]:
        """The queues `ls` and `stats` show for the configured `names`: a tenant's own; for everyone else
        the shared ones plus every tenant queue of them that workers serve (they register it in
        `rq:queues`, which tenants cannot write, so the set stays bounded)."""
        shown = [self.queue(name) for name in dict.fromkeys(names)]
        if self.settings.tenant_ids and not self.settings.operator:
            return shown
        registered = sorted(k.decode().removeprefix("rq:queue:") for k in self.connection.smembers("rq:queues"))
        return shown + [self.queue(n) for n in registered if queue_tenant(n) and base_queue(n) in names]

    def stats(self, *, queues: list[str] | None = None, failures: int = 5) -> Stats:
        names = list(dict.fromkeys(queues or self.settings.queues))
        with unavailable_on_error(self.settings.redis_url):
            qstats = []
            failed_ids: list[tuple[str, str]] = []
            shown = self.view_queues(names)
            for q in shown:
                name = q.name
                # cleanup=False: reading must never trigger RQ's registry maintenance (rq#2135).
                qstats.append(
                    QueueStats(
                        name=name,
                        queued=q.count,
                        started=q.started_job_registry.get_job_count(cleanup=False),
                        finished=q.finished_job_registry.get_job_count(cleanup=False),
                        failed=q.failed_job_registry.get_job_count(cleanup=False),
                        canceled=q.canceled_job_registry.get_job_count(cleanup=False),
                        deferred=q.deferred_job_registry.get_job_count(cleanup=False),
                        scheduled=q.scheduled_job_registry.get_job_count(cleanup=False),
                    )
                )
                registry = FailedJobRegistry(name, connection=self.connection, serializer=JSONSerializer)
                # Newest last in the registry (scored by expiry); take the tail.
                for job_id in registry.get_job_ids(-failures, -1, cleanup=False):
                    if self._may_read(job_id):
                        failed_ids.append((name, job_id))
            served = {q.name for q in shown}
            workers = [self._worker_info(w) for w in live_workers(self.connection)]  # (Worker.all() writes)
            workers = [w for w in workers if not names or set(w.queues) & served]
            recent = []
            for name, job_id in failed_ids:
                try:
                    info = self._read(job_id)
                    if not self._visible(info):
                        continue
                except JobUnreadable as exc:
                    recent.append(
                        FailureInfo(job_id=job_id, queue=name, reason="unreadable", message=str(exc), ended_at=None)
                    )
                    continue
                except JobNotFound:
                    continue
                error = info.error or {}
                recent.append(
                    FailureInfo(
                        job_id=job_id,
                        queue=name,
                        reason=error.get("reason"),
                        message=str(error.get("message") or ""),
                        ended_at=info.ended_at,
                    )
                )
            recent.sort(key=lambda f: f.ended_at.timestamp() if f.ended_at else 0.0, reverse=True)
            return Stats(
                queues=qstats,
                workers=sorted(workers, key=lambda w: w.name),
                failures=recent[:failures],
                max_queue_depth=self.settings.max_queue_depth,
                client=self.settings.client,
                client_quota=self.settings.client_quota,
                client_unfinished=self._client_unfinished(self.settings.client),
            )

    def _worker_info(self, worker: Any) -> WorkerInfo:
        health, error = None, None
        try:
            health = read_health(self.connection.get(worker_health_key(worker.name)))
        except SnapshotError as exc:
            error = str(exc)
        return WorkerInfo(
            name=worker.name,
            state=str(worker.get_state()),
            queues=worker.queue_names(),
            current_job=worker.get_current_job_id(),
            group=health.group if health is not None else None,
            fleet_state=health.fleet.state if health is not None and health.fleet is not None else None,
            last_heartbeat=worker.last_heartbeat,
            health=health,
            health_error=error,
        )

    def _client_unfinished(self, client: str) -> int:
        live = 0
        for member in self.connection.zrange(client_key(client), 0, -1):
            status = self.connection.hget(Job.key_for(member.decode()), "status")
            if status is not None and status.decode() not in TERMINAL_STATUSES:
                live += 1
        return live
