"""Redis and RQ, tenants, and admission: how a worker takes jobs (fields of `WorkerSettings`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from ltx_contract.keys import check_tenant_name
from ltx_contract.shared_settings import split_list

__all__ = ["QueueFields"]


class QueueFields(BaseModel):
    """Redis/RQ, tenant and admission fields; `redis_url` and `queues` are checked by
    `ltx_contract.redis_conn.ServiceAccess`, the other base of `WorkerSettings`."""

    # ---- Redis / RQ ---------------------------------------------------------------------------------
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for queues, job state and events")
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["ltx-render"],
        description="queues to take jobs from, highest priority first (comma-separated or a JSON list)",
    )
    worker_name: str | None = Field(
        None, description="RQ worker name prefix (default: host name); the group and pid are appended"
    )
    result_ttl: int = Field(86400, ge=-1, description="seconds a finished job, its result and events stay")
    failure_ttl: int = Field(7 * 86400, ge=1, description="seconds a failed job stays (RQ's default: 1 year)")
    events_maxlen: int = Field(1000, ge=10, description="approximate cap of entries per job event stream")
    heartbeat_interval: float = Field(10.0, gt=0, description="seconds between heartbeats while a job runs")
    job_heartbeat_ttl: int = Field(
        60, ge=5, description="seconds without a heartbeat after which a running job counts as abandoned"
    )
    worker_ttl: int = Field(60, ge=20, description="seconds an idle worker's registration lives between beats")
    tenant_ids: bool = Field(
        False,
        description="job ids are '<client>-<id>' (tenant Redis users, `ltx-worker redis-acl`): a job whose meta "
        "client is not its id's prefix is refused as invalid_request",
    )
    tenants: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="tenants (the `--tenant`s of `ltx-worker redis-acl`) whose own queues '<queue>:t:<tenant>' "
        "this worker serves next to the shared queues, in turn; needs tenant_ids (comma-separated or JSON)",
    )
    tenant_redis_bytes: int = Field(
        0,
        ge=-1,
        description="Redis memory each tenant's keys may hold before workers delete them, largest and "
        "ended first (worker.jobs.tenant_memory); 0: half of Redis's maxmemory shared among the tenants; -1: off",
    )
    max_request_bytes: int = Field(
        1 << 20, ge=4096, description="largest job data (the request) decompressed; a bigger job is refused"
    )
    max_meta_bytes: int = Field(
        64 << 10, ge=4096, description="largest job meta (the producer's summary and extra meta); bigger is refused"
    )
    maintenance_interval: int = Field(
        60, ge=1, description="seconds between RQ registry cleanups (abandoned-job detection latency)"
    )

    # ---- admission (the producer's caps, held by the worker too: worker.rq.loop.admission) -------------------
    max_queue_depth: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="jobs that may wait in `queues` together; the newest beyond are ended as queue_full "
        "without running (unset or 0: no cap; the producer reads the same variable)",
    )
    client_quota: int | None = Field(
        None,
        ge=0,
        le=100_000,
        description="unfinished jobs of one client (meta `client`; none: anonymous); a job with this many of "
        "its client's ahead of it is ended as quota_exceeded (unset or 0: none; the producer reads it too)",
    )

    @field_validator("max_queue_depth", "client_quota", mode="before")
    @classmethod
    def _limit_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none"):
            return None
        return value

    @field_validator("tenants", mode="before")
    @classmethod
    def _parse_tenants(cls, value: Any) -> Any:
        return split_list(value, ",")

    @field_validator("tenants")
    @classmethod
    def _check_tenants(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(check_tenant_name(t) for t in value))

    @property
    def depth_cap(self) -> int | None:
        """`max_queue_depth`, None when off (0 means off, as for the producer)."""
        return self.max_queue_depth or None

    @property
    def quota(self) -> int | None:
        """`client_quota`, None when off (0 means off, as for the producer)."""
        return self.client_quota or None
