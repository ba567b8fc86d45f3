"""`WorkerHealth`: the health snapshot a worker keeps at `ltx:worker:<name>:health` (and serves at /healthz
with `live` and `ready` added), typed once for the worker that writes it and the producer that reads it.

`to_json()` is the snapshot's JSON object; `WorkerHealth.from_json(data)` reads one back from any worker
version: a missing key takes its default (None for what an older worker did not publish), an unknown key
is ignored, and a value of the wrong type raises `SnapshotError` with one line naming the field
(`read_health` does the same for the raw bytes from Redis). Open-ended parts stay plain objects: `limits`
(read with `runner_limits()`, see `ltx_contract.limits`), the fleet's `startup` report and its
`last_failure`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ltx_contract.limits import RunnerLimits
from ltx_contract.typed_json import SnapshotError, dump, load

__all__ = [
    "FleetHealth",
    "LoraOffer",
    "RedisHealth",
    "SnapshotError",
    "StorageHealth",
    "UploadsHealth",
    "WorkerHealth",
    "read_health",
]


@dataclass(frozen=True)
class FleetHealth:
    """The worker's warm fleet (`worker.render.fleet.Fleet`)."""

    state: str | None = None  #: starting, ready, failed, stopped
    alive: bool = False
    pids: tuple[int, ...] = ()
    world_size: int | None = None
    devices: tuple[str, ...] = ()
    builds: int = 0  #: successful builds (1 = the initial start)
    rebuilds: int = 0  #: successful builds after a failure
    failures: int = 0  #: poisoned fleets, all time
    ready_at: float | None = None  #: wall clock when the current fleet became warm
    last_failure: dict[str, Any] | None = None  #: the last poisoning: reason, rank, exit code
    startup: dict[str, Any] | None = None  #: the last successful start's phases (`ltx_mgpu.control.startup`)


@dataclass(frozen=True)
class UploadsHealth:
    """The background upload pipeline (`worker.stages.upload`) and the worker's back-pressure."""

    pending: int = 0  #: renders in the spool waiting for their upload
    encoding: int = 0  #: renders whose video is still being encoded
    pending_bytes: int = 0
    in_flight: int = 0
    full: bool = False  #: at `max_pending` or `max_pending_bytes`: the worker takes no job
    max_pending: int | None = None
    max_pending_bytes: int | None = None
    uploaded: int = 0
    failed: int = 0
    backpressure: bool = False  #: waiting for upload room before the next dequeue (not ready meanwhile)
    backpressure_reason: str | None = None  #: why (pending uploads, the spool's disk nearly full)
    background: bool | None = None  #: LTX_UPLOAD_PIPELINE: uploads run after the job returns


@dataclass(frozen=True)
class StorageHealth:
    state: str = "ok"  #: ok or degraded
    error: str | None = None  #: why storage is degraded


@dataclass(frozen=True)
class RedisHealth:
    """`worker.protocol.redis_outage.RedisOutage`: whether the worker reaches Redis."""

    up: bool = True
    since: float | None = None  #: wall clock of the last change
    reason: str | None = None
    outages: int = 0


@dataclass(frozen=True)
class LoraOffer:
    """What LoRAs the worker takes (`producer submit --dry-run` checks requests against it)."""

    names: tuple[str, ...] | None = None  #: the catalogue's names (at most 1000); None: not published
    s3_prefixes: tuple[str, ...] = ()
    max_per_request: int | None = None
    shared_prefixes: tuple[str, ...] = ()  #: read by every tenant (LTX_LORA_SHARED_PREFIXES)
    per_tenant: bool = False  #: a tenant's uri must be under `<s3 prefix>/<tenant>/` (or a shared prefix)


@dataclass(frozen=True)
class WorkerHealth:
    worker: str | None = None  #: the RQ worker name
    group: str | None = None  #: the device group
    queues: tuple[str, ...] = ()
    runner: str | None = None
    limits: dict[str, Any] | None = None  #: `RunnerLimits.to_json()`; read with `runner_limits()`
    loras: LoraOffer | None = None
    fleet: FleetHealth | None = None
    current_job: str | None = None
    uploads: UploadsHealth | None = None
    storage: StorageHealth | None = None
    redis: RedisHealth | None = None
    jobs_done: int | None = None
    metrics_port: int | None = None
    pid: int | None = None
    process_started_at: float | None = None
    ts: float | None = None  #: wall clock of the snapshot

    def to_json(self) -> dict[str, Any]:
        return dump(self)

    @classmethod
    def from_json(cls, data: Any) -> WorkerHealth:
        return load(cls, data, "health")

    def runner_limits(self) -> RunnerLimits | None:
        """The request limits this worker publishes; None if it publishes none (or unreadable ones)."""
        return RunnerLimits.from_json(self.limits)


def read_health(raw: bytes | str | None) -> WorkerHealth | None:
    """The snapshot stored in Redis (None if the key is absent); `SnapshotError` if it is not one."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise SnapshotError(f"health: not JSON ({exc})") from None
    return WorkerHealth.from_json(data)
