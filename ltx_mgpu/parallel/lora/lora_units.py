"""What a LoRA tracker (`lora_tracker.LoraWeightTracker`) works on: the LoRA it is asked to fuse (`LoraSpec`),
which weights of a model it tracks (`tracked_tensors`; their shapes for the memory plan: `lora_units`), which rank
owns each (`assign_owners`), and which of them a LoRA file touches (`lora_targets`, from its header alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SCALE_SUFFIX", "LoraSpec", "assign_owners", "lora_targets", "lora_units", "tracked_tensors"]

SCALE_SUFFIX = ".weight_scale"


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to fuse: a safetensors file, a strength and the key mapping (ltx-core `SDOps` or None)."""

    path: str
    strength: float = 1.0
    sd_ops: Any = None

    @property
    def identity(self) -> tuple[str, float, str]:
        return (str(self.path), float(self.strength), getattr(self.sd_ops, "name", "") or "")

    @property
    def factor_key(self) -> tuple[str, str]:
        """What the kept factors depend on: the file and the key mapping, not the strength."""
        return (str(self.path), getattr(self.sd_ops, "name", "") or "")

    @classmethod
    def coerce(cls, lora: Any) -> LoraSpec:
        """Accept a `LoraSpec`, an ltx-core `LoraPathStrengthAndSDOps` or a (path, strength[, sd_ops]) tuple."""
        if isinstance(lora, LoraSpec):
            return lora
        if hasattr(lora, "path") and hasattr(lora, "strength"):
            return cls(str(lora.path), float(lora.strength), getattr(lora, "sd_ops", None))
        path, strength, *rest = lora
        return cls(str(path), float(strength), rest[0] if rest else None)


def assign_owners(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Deterministic greedy balance: units (a weight plus its scale) by descending bytes, each to the
    least-loaded rank (ties: lowest rank). Same answer on every rank for the same names and sizes."""
    units: dict[str, list[str]] = {}
    for key in sizes:
        base = key[: -len(SCALE_SUFFIX)] + ".weight" if key.endswith(SCALE_SUFFIX) else key
        units.setdefault(base, []).append(key)
    order = sorted(units, key=lambda b: (-sum(sizes[k] for k in units[b]), b))
    load = [0] * world_size
    owners: dict[str, int] = {}
    for base in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        for key in units[base]:
            owners[key] = rank
        load[rank] += sum(sizes[k] for k in units[base])
    return owners


def tracked_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor `attach` backs up: each >= 2-D floating `*.weight` and its `*.weight_scale` if any."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    working: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if name.endswith(".weight") and p.dim() >= 2 and torch.is_floating_point(p):
            working[name] = p.data
            scale = name[: -len(".weight")] + SCALE_SUFFIX
            if scale in params or scale in buffers:
                working[scale] = (params.get(scale) if scale in params else buffers[scale]).data
    return working


def lora_units(model: torch.nn.Module, *, float_bytes: int | None = None) -> dict[str, tuple[int, int, int]]:
    """Weight name -> (out, in, bytes with its scale) of what `attach` backs up: `memory_plan.lora_figures`'
    input, so the memory plan's LoRA figures come from the same selection as the tracker's allocations.
    `float_bytes`: count the non-float8 weights at this width (a meta model built in float32 standing for
    the bfloat16 one a runner loads); scales keep their own width."""
    tensors = tracked_tensors(model)
    units: dict[str, tuple[int, int, int]] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        width = t.element_size() if float_bytes is None or t.element_size() == 1 else float_bytes
        scale = tensors.get(name[: -len(".weight")] + SCALE_SUFFIX)
        extra = 0 if scale is None else scale.numel() * scale.element_size()
        units[name] = (int(t.shape[0]), int(math.prod(t.shape[1:])), t.numel() * width + extra)
    return units


def lora_targets(spec: LoraSpec) -> dict[str, tuple[str, str]]:
    """Model weight key -> (raw lora_A name, raw lora_B name) in the file, from the header only."""
    from safetensors import safe_open

    mapped: dict[str, str] = {}
    with safe_open(spec.path, framework="pt") as f:
        for raw in f.keys():
            key = raw if spec.sd_ops is None else spec.sd_ops.apply_to_key(raw)
            if key is not None:
                mapped[key] = raw
    out: dict[str, tuple[str, str]] = {}
    for key, raw in mapped.items():
        if key.endswith(".lora_A.weight"):
            prefix = key[: -len(".lora_A.weight")]
            raw_b = mapped.get(f"{prefix}.lora_B.weight")
            if raw_b is not None:
                out[f"{prefix}.weight"] = (raw, raw_b)
    return out
