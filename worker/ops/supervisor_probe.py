"""The supervisor's own metrics and probes (`ltx-worker`, one process over every worker process).

A worker process answers its own `/readyz` (`worker.ops.metrics`), but only while it runs: between a crash and
its restart, or while it keeps exiting before it ever became ready, nothing answers on its port, and a
refused connection says nothing about why. The supervisor sees every exit, so it says it here, on
`LTX_SUPERVISOR_PORT` (off unless set):

- `GET /metrics`: `ltx_supervisor_worker_ready{group}` (1 while that group's current worker process's last
  report says ready), `ltx_supervisor_never_ready_exits{group}` (its exits in a row before it was ever ready),
  `ltx_supervisor_crash_loop{group}` (1 from `LTX_RESTART_ALARM_AFTER` such exits until a worker is ready),
  `ltx_supervisor_restarts_total{group}`;
- `GET /healthz`: 200 while the supervisor's loop runs;
- `GET /readyz`: 200 only while every group's worker process runs and its last report says ready (the very
  answer of its own `/readyz`: `worker.runtime.readiness`); else 503 with `reason` naming each group that is
  not, with the worker's reason (and, in a crash loop, its exits in a row and last exit code).
Both return `{"live", "ready", "reason", "groups": [...]}` as JSON. Served by `worker.ops.probe_server`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from worker.ops.probe_server import ProbeServer, Reply

__all__ = ["SupervisorMetrics", "SupervisorProbes"]


class SupervisorMetrics:
    """The supervisor's metric families (a registry of its own); every sample carries `group`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.worker_ready = Gauge(
            "ltx_supervisor_worker_ready",
            "1 while the group's worker process's last report says ready (its /readyz)",
            ["group"],
            registry=r,
        )
        self.never_ready_exits = Gauge(
            "ltx_supervisor_never_ready_exits",
            "Exits in a row of the group's worker before it was ever ready",
            ["group"],
            registry=r,
        )
        self.crash_loop = Gauge(
            "ltx_supervisor_crash_loop",
            "1 while the group's worker keeps exiting before it "
            "is ready (LTX_RESTART_ALARM_AFTER exits in a row or more)",
            ["group"],
            registry=r,
        )
        self.restarts = Counter(
            "ltx_supervisor_restarts", "Worker processes restarted after an unasked exit", ["group"], registry=r
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class SupervisorProbes:
    """`/metrics`, `/healthz`, `/readyz` of the supervisor; `status()` returns (ready, reason, groups)."""

    def __init__(
        self,
        metrics: SupervisorMetrics,
        status: Callable[[], tuple[bool, str | None, list[dict[str, Any]]]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        def route(path: str) -> Reply:
            if path == "/metrics":
                return 200, metrics.exposition(), CONTENT_TYPE_LATEST
            if path in ("/healthz", "/readyz", "/"):
                ready, reason, groups = status()
                ok = ready if path == "/readyz" else True
                body = json.dumps({"live": True, "ready": ready, "reason": reason, "groups": groups}, default=str)
                return (200 if ok else 503), body.encode(), "application/json"
            return 404, b"not found\n", "text/plain"

        self.server = ProbeServer(route, host=host, port=port)
        self.port = self.server.port

    def start(self) -> SupervisorProbes:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
