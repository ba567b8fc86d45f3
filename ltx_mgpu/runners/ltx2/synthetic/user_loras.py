"""Synthetic user LoRAs: the files a request names (`loras`), at real size, for benchmarks of fetch, check and
swap.

    python -m ltx_mgpu.runners.ltx2.synthetic.user_loras --profile full|tiny --out DIR [--ranks 32,128]
                                                          [--seed N] [--device cuda|cpu] [--plan]

writes `DIR/user_lora_r<rank>.safetensors` per rank: ComfyUI keys (`diffusion_model.<linear>.lora_A.weight`
(rank, in) and `.lora_B.weight` (out, rank)) over the attention projections of every transformer block
(`to_q`, `to_k`, `to_v`, `to_out.0` of the self-, cross- and audio/video cross-modal attentions): the
modules LoRA trainers for LTX-2 target by default, as opposed to the distilled LoRA's every linear layer.
Fills as the distilled LoRA's (`plan.lora_plan`). Put such files in a worker's `LTX_LORA_CATALOGUE` or
under an allowed S3 prefix (docs/runners.md, "Adding a LoRA catalogue"). Synthetic: the metadata says so.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...common.weights import TensorSpec, write_safetensors
from .plan import FilePlan, transformer_meta
from .profiles import Profile, profile

__all__ = ["USER_LORA_TARGETS", "user_lora_plan", "write_user_lora", "write_user_loras"]

#: the attention projections user LoRAs train (the suffix of each `nn.Linear` name in a block)
USER_LORA_TARGETS = (".to_q", ".to_k", ".to_v", ".to_out.0")


def user_lora_plan(prof: Profile, rank: int) -> FilePlan:
    """Rank-`rank` A/B pairs over the attention projections of the profile's transformer blocks."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    specs = []
    for name, module in transformer_meta(prof).named_modules():
        if not (name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear)):
            continue
        if not name.endswith(USER_LORA_TARGETS):
            continue
        out_features, in_features = module.weight.shape
        key = f"diffusion_model.{name}"
        specs.append(TensorSpec(f"{key}.lora_A.weight", (rank, in_features), prof.dtype, "normal", in_features**-0.5))
        specs.append(TensorSpec(f"{key}.lora_B.weight", (out_features, rank), prof.dtype, "normal", 0.1 * rank**-0.5))
    meta = {"synthetic": "true", "profile": prof.name, "rank": str(rank)}
    return FilePlan(f"user_lora_r{rank}.safetensors", "user_lora", specs, meta)


def write_user_loras(
    name: str, out: str | Path, *, ranks: Sequence[int] = (32, 128), seed: int = 0, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Write one user LoRA per rank under `out`; one report row per file (path, bytes, seconds)."""
    return [
        write_user_lora(
            name, Path(out) / f"user_lora_r{int(rank)}.safetensors", int(rank), seed=seed + 40 + i, device=device
        )
        for i, rank in enumerate(ranks)
    ]


def write_user_lora(name: str, path: str | Path, rank: int, *, seed: int, device: str = "cpu") -> dict[str, Any]:
    """One user LoRA of profile `name` at `path`; files of different seeds are different LoRAs (distinct
    bytes, so distinct cache entries and S3 ETags). Full profile, rank 128: 1,711,276,032 bytes of tensors."""
    plan = user_lora_plan(profile(name), rank)
    return write_safetensors(path, plan.specs, seed=seed, device=device, metadata=plan.metadata)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ltx_mgpu.runners.ltx2.synthetic.user_loras")
    parser.add_argument("--profile", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ranks", default="32,128", help="comma-separated ranks, one file each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plan", action="store_true", help="print each file's size, write nothing")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    if args.plan:
        for rank in ranks:
            plan = user_lora_plan(profile(args.profile), rank)
            print(json.dumps({"file": plan.relpath, "tensors": len(plan.specs), "bytes": plan.nbytes}), flush=True)
        return
    for row in write_user_loras(args.profile, args.out, ranks=ranks, seed=args.seed, device=args.device):
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
