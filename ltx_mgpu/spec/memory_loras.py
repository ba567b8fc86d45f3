"""What the LoRA tracker holds on a GPU, in the memory plan's terms (`memory_plan`, "LoRAs" in docs/memory.md).

Its own module because these figures have readers of their own (the placement's host tier, the worker's
request-LoRA limits, the tracker's tests) and change with the tracker, not with the stage model. Stdlib only,
like the rest of `ltx_mgpu.spec`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (memory_plan imports this module: the fleet's type only, no cycle at run time)
    from ltx_mgpu.spec.memory_plan import FleetMemory
    from ltx_mgpu.spec.memory_profile import ModelProfile

__all__ = ["LORA_FACTOR_BYTES", "LORA_STAGING_GIB", "lora_figures", "lora_parts", "with_lora_limits"]

GIB = float(1 << 30)
LORA_STAGING_GIB = 0.25  #: `LoraWeightTracker(bucket_bytes=256 MiB)`: its broadcast buffer, kept on W > 1
LORA_FACTOR_BYTES = 4  #: the widest factor dtype a LoRA file may hold (F32, `lora_file.LORA_DTYPES`): kept as read


def with_lora_limits(fleet: FleetMemory, per_request: int, max_file_bytes: int, max_rank: int) -> FleetMemory:
    """`fleet` with the worker's request-LoRA limits (`lora_max_*` settings), where it takes request LoRAs."""
    if fleet.request_loras:
        fleet = replace(
            fleet, request_loras=int(per_request), lora_max_file_bytes=int(max_file_bytes), lora_max_rank=int(max_rank)
        )
    return fleet


def lora_figures(units: Any) -> dict[str, float]:
    """The tracker's figures from the transformer's tensor shapes: `units` is (out, in, bytes with its scale) of
    every weight `LoraWeightTracker.attach` backs up (`lora_tracker.lora_units`). Returns the clean copy and
    its largest unit (GiB) and the sum of out + in (`ModelProfile`'s `lora_*` fields)."""
    units = list(units)
    sizes = [int(b) for _, _, b in units]
    return {
        "weights_gib": sum(sizes) / GIB,
        "unit_gib": max(sizes, default=0) / GIB,
        "width_sum": sum(int(o) + int(i) for o, i, _ in units),
    }


def lora_parts(fleet: FleetMemory, p: ModelProfile) -> dict[str, float]:
    """What the LoRA tracker holds on the rank with the most of it (GiB, unrounded; empty: no tracker).

    - `lora_backup`: the clean copy. Owners are a greedy balance on bytes (`assign_owners`), so one rank holds
      at most 1/W of it plus its largest weight (exactly all of it on one rank).
    - `lora_staging`: the broadcast's bucket (W > 1 only; one rank fuses, all receive).
    - `lora_factors`: `keep_loras` keeps on the device the factors of each LoRA it fused, for the weights the
      rank owns. The setup's (the distilled LoRA: every block linear) split like the weights; a job's
      (`lora_job_factors`) are bounded per LoRA by the worker's limits, file bytes and rank x `lora_width_sum`
      x 4 (float32, kept as read), not divided by W: a LoRA may name only weights one rank owns.
    - `lora_cache`: past jobs' factors `drop_factors` keeps, at most `lora_device_cache_gib` per rank.
    Parts the placement keeps in host memory (`lora_backup_at`, `lora_factors_at` "host") are not on the GPU and
    not listed (`placement.host_parts` counts them)."""
    if not fleet.has_tracker:
        return {}
    world = fleet.world_size
    total = p.lora_weights_fp8_gib if fleet.fp8_transformer else p.lora_weights_gib
    share = total if world == 1 else min(total, total / world + p.lora_unit_gib)
    setup = fleet.setup_lora_gib
    setup = (p.lora_factors_gib if fleet.runner == "two-stage" else 0.0) if setup is None else setup
    per_lora = min(fleet.lora_max_file_bytes, fleet.lora_max_rank * p.lora_width_sum * LORA_FACTOR_BYTES) / GIB
    parts = {"lora_backup": share} if fleet.lora_backup_at == "gpu" else {}
    if setup and fleet.lora_factors_at == "gpu":
        parts["lora_factors"] = setup * (share / total if total else 1.0)
    if world > 1:
        parts["lora_staging"] = LORA_STAGING_GIB
    if fleet.request_loras:
        parts["lora_job_factors"] = fleet.request_loras * per_lora
        if fleet.lora_device_cache_gib:
            parts["lora_cache"] = float(fleet.lora_device_cache_gib)
    return parts
