"""What operators see: the metrics and probe ports, logging (fields of `WorkerSettings`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

__all__ = ["ObservabilityFields"]


class ObservabilityFields(BaseModel):
    """Metrics, probe and log fields."""

    # ---- observability -------------------------------------------------------------------------------
    metrics_port: int | None = Field(
        9400,
        ge=0,
        le=65535,
        description="Prometheus /metrics and /healthz port of group 0 (group i: +i); 0 = any free port, unset = off",
    )
    supervisor_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="the supervisor's /metrics, /healthz and /readyz (every group's worker "
        "ready, else why not); 0 = any free port, unset = off",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="address /metrics and /healthz listen on (loopback; compose sets 0.0.0.0)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"

    @field_validator("metrics_port", "supervisor_port", mode="before")
    @classmethod
    def _metrics_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none", "false"):
            return None
        return value

    def metrics_port_for(self, index: int) -> int | None:
        if self.metrics_port is None:
            return None
        return 0 if self.metrics_port == 0 else self.metrics_port + index
