"""Synthetic LTX-2 checkpoint sets: the real architectures and file layouts, seeded random weights.

    python -m ltx_mgpu.runners.ltx2.synthetic --profile full|tiny --out DIR [--seed N] [--device cuda|cpu]
                                              [--components monolith,upsampler,lora,gemma] [--plan]

writes, under DIR, what the LTX-2 runners' setup kwargs point at (`Ltx2Files.setup_kwargs()`):

- `ltx2.safetensors`, the monolith: AV transformer + text connectors, text projection, video VAE encoder +
  decoder, audio VAE decoder + vocoder, config in the metadata (full: 19B transformer, 43.4 GB);
- `upsampler.safetensors`: the x2 latent spatial upsampler (full: 0.25 GB);
- `distilled_lora.safetensors`: the distilled LoRA, ComfyUI keys (full: rank 384, 7.4 GB);
- `gemma/`: a Gemma 3 root: config.json, `model-0000k-of-0000n.safetensors` + index, tokenizer, processor
  config (full: 12B, 24.4 GB in 5 shards).

The dimensions, and where each comes from, are in `profiles.py`; the key layouts in `plan.py`; how tensors
are filled and streamed in `common/weights.py`. `tiny` is what the tests use (`ensure_tiny_ltx2()`); `full`
is LTX-2 19B at the published dimensions, for real timings and memory on GPUs.

Renders from synthetic weights are noise. Every file says `synthetic: "true"` in its safetensors metadata
and the runners log that at setup and put `synthetic_weights: true` in their `output` event.

Speed: tensors are generated on `--device` (use cuda on a GPU host: generation is then negligible) and
streamed to disk through two staging buffers, so host memory stays at a few hundred MB whatever the size;
the disk is the limit (tmpfs such as /dev/shm, or local NVMe). One JSON line per file (bytes, seconds,
GB/s) and a final summary line are printed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...common.weights import write_json, write_safetensors
from .gemma_files import build_tokenizer, gemma_config, write_side_files
from .plan import GEMMA_DIR, LORA, MONOLITH, UPSAMPLER, FilePlan, gemma_plans, lora_plan, monolith_plan, upsampler_plan
from .profiles import PROFILES, Profile, profile

__all__ = ["COMPONENTS", "PROFILES", "Ltx2Files", "plan_files", "write_checkpoints"]

COMPONENTS = ("monolith", "upsampler", "lora", "gemma")
_SEED_OFFSETS = {"monolith": 0, "upsampler": 10, "lora": 20, "gemma": 30}


@dataclass(frozen=True)
class Ltx2Files:
    """Paths of an LTX-2 checkpoint set (real or synthetic): what the runners' setup kwargs name."""

    directory: Path
    checkpoint: Path  #: the monolith (transformer, video VAE, audio VAE decoder + vocoder, text projection)
    upsampler: Path
    distilled_lora: Path
    gemma_root: Path

    @classmethod
    def under(cls, directory: str | Path) -> Ltx2Files:
        d = Path(directory)
        return cls(d, d / MONOLITH, d / UPSAMPLER, d / LORA, d / GEMMA_DIR)

    def setup_kwargs(self) -> dict[str, str]:
        return {
            "checkpoint_path": str(self.checkpoint),
            "spatial_upsampler_path": str(self.upsampler),
            "gemma_root": str(self.gemma_root),
            "distilled_lora_path": str(self.distilled_lora),
        }


def _check_components(components: Sequence[str]) -> list[str]:
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"unknown components {unknown}; expected a subset of {list(COMPONENTS)}")
    return [c for c in COMPONENTS if c in components]


def plan_files(name: str, components: Sequence[str] = COMPONENTS) -> list[FilePlan]:
    """Every file's tensor plan (names, shapes, dtypes; no tensor memory) for profile `name`."""
    prof = profile(name)
    plans: list[FilePlan] = []
    for component in _check_components(components):
        if component == "gemma":
            plans += gemma_plans(prof, gemma_config(prof, build_tokenizer(prof.full_vocab)))
        else:
            plans.append({"monolith": monolith_plan, "upsampler": upsampler_plan, "lora": lora_plan}[component](prof))
    return plans


def _write_gemma_index(root: Path, plans: list[FilePlan]) -> None:
    weight_map = {spec.name: Path(p.relpath).name for p in plans for spec in p.specs}
    total = sum(p.nbytes for p in plans)
    write_json(root / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_checkpoints(
    name: str,
    out: str | Path,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    components: Sequence[str] = COMPONENTS,
    report: Callable[[dict[str, Any]], None] | None = None,
    skip_existing: bool = False,
) -> Ltx2Files:
    """Write the `components` of profile `name` under `out`; `report` gets one dict per file and a summary."""
    prof: Profile = profile(name)
    files = Ltx2Files.under(out)
    start, total = time.perf_counter(), 0
    for component in _check_components(components):
        if component == "gemma":
            tok = build_tokenizer(prof.full_vocab)
            config = gemma_config(prof, tok)
            plans = gemma_plans(prof, config)
            write_side_files(files.gemma_root, prof, tok, config)
            _write_gemma_index(files.gemma_root, plans)
        else:
            plans = [{"monolith": monolith_plan, "upsampler": upsampler_plan, "lora": lora_plan}[component](prof)]
        for plan in plans:
            path = files.directory / plan.relpath
            if skip_existing and path.exists():
                continue
            row = write_safetensors(
                path, plan.specs, seed=seed + _SEED_OFFSETS[component], device=device, metadata=plan.metadata
            )
            total += row["bytes"]
            if report is not None:
                gbps = row["bytes"] / max(row["seconds"], 1e-9) / 1e9
                report({"event": "file", "component": component, **row, "gb_per_s": round(gbps, 3)})
    if report is not None:
        seconds = time.perf_counter() - start
        report(
            {
                "event": "done",
                "profile": name,
                "device": str(device),
                "bytes": total,
                "seconds": round(seconds, 3),
                "directory": str(files.directory),
            }
        )
    return files


def print_json(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True, file=sys.stdout)
