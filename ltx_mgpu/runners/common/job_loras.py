"""A job's request LoRAs on the ranks: parsed and checked identically on every rank, before any collective.

The worker resolves a request's `loras` to checked local files (`worker.render.loras`) and passes
`[{"path", "strength"}]` as the job kwarg. The ranks do not trust that: each rank re-reads every file's
header against the weights the tracker holds (`ltx_mgpu.lora_file.check_lora`, shapes from the resident
model, so a file changed after the worker's check is still refused) and raises `ValueError`, the same on
every rank, so a bad job is a `SymmetricRunnerError` and the fleet stays up with its weights untouched.

How they combine (the reference pipelines' way, ltx-core `apply_loras`): a stage fuses the runner's own
LoRAs plus the job's, each delta `strength * B @ A`, summed per weight and added to the clean weight once.
So stage 1 runs with `base + job` and the two-stage runner's stage 2 with `base + distilled + job`; the next
job's swap restores the clean bytes of every key it touched (bit for bit) before fusing its own set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...lora_file import LoraFileError, LoraLimits, check_lora
from ...parallel.lora.lora_tracker import LoraSpec

__all__ = ["job_lora_specs", "model_targets"]

#: a rank's own bound, independent of the worker's settings (which the rank does not see)
RANK_LIMITS = LoraLimits(max_file_bytes=1 << 40, max_rank=4096)


def model_targets(model: Any) -> dict[str, tuple[int, int]]:
    """The resident model's LoRA-able weights: 2-D floating `*.weight` parameters, name -> (out, in)."""
    return {
        name: (int(p.shape[0]), int(p.shape[1]))
        for name, p in model.named_parameters()
        if name.endswith(".weight") and p.dim() == 2 and p.is_floating_point()
    }


def job_lora_specs(loras: Sequence[Any] | None, targets: Mapping[str, tuple[int, int]] | None) -> tuple[LoraSpec, ...]:
    """`[{"path", "strength"}]` -> specs with ltx-core's ComfyUI key mapping; `ValueError` on anything else.

    `targets` None means this runner holds no LoRA tracker (it was set up without LoRA fusion)."""
    if not loras:
        return ()
    if targets is None:
        raise ValueError("this runner was set up without LoRA fusion; set request_loras=True (bfloat16 weights)")
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

    specs = []
    for i, item in enumerate(loras):
        if not isinstance(item, Mapping) or set(item) != {"path", "strength"}:
            raise ValueError(f"loras[{i}] must be {{'path', 'strength'}} (resolved by the worker), got {item!r:.200}")
        path, strength = item["path"], item["strength"]
        if not isinstance(path, str) or isinstance(strength, bool) or not isinstance(strength, int | float):
            raise ValueError(f"loras[{i}]: path must be a string and strength a number")
        if not math.isfinite(float(strength)):
            raise ValueError(f"loras[{i}]: strength must be finite, got {strength}")
        try:
            check_lora(path, targets, RANK_LIMITS)
        except LoraFileError as exc:
            raise ValueError(f"loras[{i}]: {exc}") from None
        specs.append(LoraSpec(path, float(strength), LTXV_LORA_COMFY_RENAMING_MAP))
    return tuple(specs)
