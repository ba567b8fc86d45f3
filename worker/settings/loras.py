"""Per-request LoRAs: the catalogue, the S3 prefixes, the limits and the cache (fields of `WorkerSettings`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from ltx_contract.shared_settings import split_list
from worker.settings.base import MIB

__all__ = ["LoraFields"]


class LoraFields(BaseModel):
    """LoRA fields (worker.render.loras)."""

    # ---- per-request LoRAs (worker.render.loras) ------------------------------------------------------------
    lora_catalogue: Path | None = Field(
        None, description="folder of <name>.safetensors a request may name (`loras[].name`); unset: none"
    )
    lora_s3_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="`bucket/prefix` entries a request's `loras[].uri` must fall under"
    )
    lora_shared_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="`bucket/prefix` entries every tenant may read LoRAs from; with tenants (tenant_ids) a "
        "`loras[].uri` must be under one of these or under `<lora_s3_prefixes entry>/<tenant>/`",
    )
    lora_max_per_request: int = Field(4, ge=0, le=8, description="LoRAs one request may ask for (0: none)")
    lora_max_file_bytes: int = Field(4 * 1024 * MIB, ge=1, description="largest LoRA file fetched or fused")
    lora_max_header_bytes: int = Field(16 * MIB, ge=1024, description="largest safetensors header read")
    lora_max_rank: int = Field(256, ge=1, description="highest LoRA rank fused")
    lora_cache_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "ltx-lora-cache",
        description="checked LoRA files, by content; shared by the worker's fleets",
    )
    lora_cache_bytes: int = Field(
        16 * 1024 * MIB,
        ge=MIB,
        description="size cap of lora_cache_dir (LRU), held at all times; one job may hold this over the worker "
        "processes sharing the folder",
    )
    lora_cache_files: int = Field(
        256,
        ge=1,
        description="file cap of lora_cache_dir (each file takes an inode, whatever its size), held at all times "
        "like lora_cache_bytes and shared the same way",
    )
    lora_cache_wait_s: float = Field(
        3600.0,
        ge=0,
        description="how long a LoRA job the cache has no room for waits, re-queued without spending a retry "
        "budget, before it fails as spool_error (a job of another group ends within a render_timeout)",
    )

    @field_validator("lora_s3_prefixes", "lora_shared_prefixes", mode="before")
    @classmethod
    def _parse_lora_prefixes(cls, value: Any) -> Any:
        return split_list(value, ",")

    def lora_limits(self) -> tuple[int, int, int]:
        """(LoRAs per request, file bytes, rank): what a request's LoRAs may hold on a fleet (the memory plan)."""
        return self.lora_max_per_request, self.lora_max_file_bytes, self.lora_max_rank
