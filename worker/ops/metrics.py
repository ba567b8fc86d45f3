"""Prometheus metrics and the health probe of one worker process (one fleet), on one HTTP port.

- `GET /metrics`: Prometheus text format, from a registry private to this process (so several worker
  processes on one machine never mix their numbers; each has its own port: metrics_port + group index).
- `GET /healthz`: liveness, 200 while the work loop has beaten recently; 503 otherwise.
- `GET /readyz`: readiness, 200 only while the fleet is up (warm and not poisoned); 503 otherwise.
Both return the JSON health snapshot (group, fleet state, pids, current job, counters). Served by
`worker.ops.probe_server` (one thread, bounded connections, a deadline per connection).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ltx_contract.health import WorkerHealth
from worker.ops.probe_server import ProbeServer, Reply

__all__ = ["HealthServer", "WorkerMetrics"]

_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
FLEET_STATES = ("new", "starting", "ready", "failed", "stopped")


class WorkerMetrics:
    """The metric families of one worker process; every sample carries the `group` label."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["group"]
        self.jobs = Counter(
            "ltx_worker_jobs",
            "Jobs by outcome (uploaded, failed, cancelled, retrying, deferred)",
            [*labels, "outcome", "reason"],
            registry=r,
        )
        self.render_seconds = Histogram(
            "ltx_worker_render_seconds", "Fleet render time per job", labels, buckets=_DURATION_BUCKETS, registry=r
        )
        self.upload_seconds = Histogram(
            "ltx_worker_upload_seconds",
            "Upload time per job (all attempts)",
            labels,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.upload_bytes = Counter("ltx_worker_upload_bytes", "Bytes confirmed in storage", labels, registry=r)
        self.upload_retries = Counter("ltx_worker_upload_retries", "Failed upload attempts", labels, registry=r)
        self.ignored_commands = Counter(
            "ltx_worker_ignored_commands",
            "RQ pubsub commands refused (shutdown: anyone who can PUBLISH could stop the service; junk)",
            [*labels, "command"],
            registry=r,
        )
        self.dropped_queue_entries = Counter(
            "ltx_worker_dropped_queue_entries",
            "Queue entries dropped without "
            "counting or running (no such job, ended, another tenant's, another "
            "queue's, malformed; worker.jobs.tenant_queues)",
            [*labels, "reason"],
            registry=r,
        )
        self.requeued_lost_pops = Counter(
            "ltx_worker_requeued_lost_pops",
            "Jobs queued again after a wait for a job lost its reply and the id it took (worker.rq.loop.lost_pops)",
            labels,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "ltx_worker_queue_wait_seconds", "Enqueue to start of a job", labels, buckets=_WAIT_BUCKETS, registry=r
        )
        self.fleet_up = Gauge("ltx_worker_fleet_up", "1 while the fleet is warm and not poisoned", labels, registry=r)
        self.fleet_state = Gauge(
            "ltx_worker_fleet_state", "1 for the fleet's current state", [*labels, "state"], registry=r
        )
        self.fleet_rebuilds = Counter(
            "ltx_worker_fleet_rebuilds", "Fleet rebuilds by result (ok, failed)", [*labels, "result"], registry=r
        )
        self.warmup_dropped = Counter(
            "ltx_worker_warmup_dropped",
            "Warm-up requests dropped at a fleet start by "
            "reason (out_of_memory: on the lower-memory plan too; refused: the plan "
            "refuses the size on these devices)",
            [*labels, "reason"],
            registry=r,
        )
        self.fleet_failures = Counter(
            "ltx_worker_fleet_failures", "Poisoned fleets by controller reason", [*labels, "reason"], registry=r
        )
        self.storage_up = Gauge(
            "ltx_worker_storage_up",
            "0 while storage is degraded (unreachable at start, not yet confirmed by an upload), else 1",
            labels,
            registry=r,
        )
        self.redis_up = Gauge(
            "ltx_worker_redis_up",
            "0 while Redis refuses the worker's commands (out of memory, "
            "read-only, loading, unreachable): no job is taken until it clears",
            labels,
            registry=r,
        )
        self.redis_up.labels(group).set(1)
        self.busy = Gauge("ltx_worker_busy", "1 while a job runs", labels, registry=r)
        self.fleet_busy_seconds = Counter(
            "ltx_worker_fleet_busy_seconds",
            "Device-busy seconds of the fleet (the runner's device stages between syncs, not its CPU tail)",
            labels,
            registry=r,
        )
        self.encode_seconds = Histogram(
            "ltx_worker_encode_seconds",
            "mp4 encode time per video in the worker",
            labels,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.encode_pending = Gauge(
            "ltx_worker_encode_pending", "Videos waiting for or in the worker's encoder", labels, registry=r
        )
        self.encode_aborted = Counter(
            "ltx_worker_encode_aborted",
            "Streamed encodes abandoned because their render failed after the first frames arrived",
            labels,
            registry=r,
        )
        self.lora_cache = Counter(
            "ltx_worker_lora_cache", "Request LoRAs by cache result (hit, miss)", [*labels, "result"], registry=r
        )
        self.lora_fetch_bytes = Counter(
            "ltx_worker_lora_fetch_bytes", "LoRA bytes fetched into the cache", labels, registry=r
        )
        self.lora_swap_seconds = Histogram(
            "ltx_worker_lora_swap_seconds",
            "Fleet LoRA swap time of a job with request LoRAs",
            labels,
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.lora_fetch_seconds = Histogram(
            "ltx_worker_lora_fetch_seconds",
            "Fetch + check time of a LoRA miss",
            labels,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.tenant_keys_deleted = Counter(
            "ltx_worker_tenant_keys_deleted",
            "Keys of a tenant over its Redis memory budget deleted by the sweep",
            [*labels, "tenant"],
            registry=r,
        )
        self.tenant_bytes_deleted = Counter(
            "ltx_worker_tenant_bytes_deleted",
            "Redis memory freed by deleting the keys of a tenant over its budget",
            [*labels, "tenant"],
            registry=r,
        )
        self.spool_entries = Gauge(
            "ltx_worker_spool_entries", "Complete renders waiting for upload", labels, registry=r
        )
        self.spool_bytes = Gauge("ltx_worker_spool_bytes", "Bytes of renders waiting for upload", labels, registry=r)
        self.upload_pending = Gauge(
            "ltx_worker_upload_pending", "Renders queued for or in background upload", labels, registry=r
        )
        self.upload_pending_bytes = Gauge(
            "ltx_worker_upload_pending_bytes", "Bytes queued for or in upload", labels, registry=r
        )
        self.backpressure = Gauge(
            "ltx_worker_backpressure",
            "1 while the worker waits for upload room before taking a job",
            labels,
            registry=r,
        )
        self.backpressure_seconds = Counter(
            "ltx_worker_backpressure_seconds",
            "Time spent waiting for upload room before taking a job",
            labels,
            registry=r,
        )
        self.fleet_start_seconds = Gauge(
            "ltx_worker_fleet_start_seconds",
            "Phases of the last fleet start: process_start, weight_load, warmup, ready (their sum)",
            [*labels, "phase"],
            registry=r,
        )
        self.set_fleet_state("new", alive=False)

    def set_fleet_startup(self, startup: dict[str, Any]) -> None:
        """Publish the phases of a fleet start (`worker.render.fleet.WarmFleet.startup`)."""
        for phase in ("process_start", "weight_load", "warmup", "ready"):
            value = startup.get(f"{phase}_s")
            if value is not None:
                self.fleet_start_seconds.labels(self.group, phase).set(float(value))

    def set_fleet_state(self, state: str, *, alive: bool) -> None:
        for s in FLEET_STATES:
            self.fleet_state.labels(self.group, s).set(1 if s == state else 0)
        self.fleet_up.labels(self.group).set(1 if alive else 0)

    def job_outcome(self, outcome: str, reason: str = "") -> None:
        self.jobs.labels(self.group, outcome, reason).inc()

    def tenant_trimmed(self, tenant: str, keys: int, freed_bytes: int) -> None:
        """A tenant over its Redis memory budget lost `keys` keys (`freed_bytes`); tenant ids are the
        operator's (`LTX_TENANT_IDS`: a key's owner is its ACL prefix), so the label stays bounded."""
        self.tenant_keys_deleted.labels(self.group, tenant).inc(keys)
        self.tenant_bytes_deleted.labels(self.group, tenant).inc(freed_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """`/metrics`, `/healthz`, `/readyz` on one bounded thread (`worker.ops.probe_server`: a flood of slow or
    half-open connections costs sockets, never threads). `snapshot()` returns (live, ready, info)."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        snapshot: Callable[[], tuple[bool, bool, WorkerHealth]],
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        max_connections: int = 256,
        timeout_s: float = 5.0,
    ) -> None:
        def route(path: str) -> Reply:
            if path == "/metrics":
                return 200, metrics.exposition(), CONTENT_TYPE_LATEST
            if path in ("/healthz", "/readyz", "/"):
                live, ready, info = snapshot()
                ok = live if path != "/readyz" else ready
                body = json.dumps({"live": live, "ready": ready, **info.to_json()}, default=str).encode()
                return (200 if ok else 503), body, "application/json"
            return 404, b"not found\n", "text/plain"

        self.server = ProbeServer(route, host=host, port=port, max_connections=max_connections, timeout_s=timeout_s)
        self.port = self.server.port

    def start(self) -> HealthServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
