"""A LoRA fused into FP8 (per-row e4m3) weights: the eager fusion and the Triton kernels side by side, in one run.

Why: the two-stage runner fuses the distilled LoRA into every transformer weight before stage 2. Into fp8-mm
weights that swap took 0.41 s on one H200 at 19B against 0.10 s into bf16 ones (docs/performance.md): the eager
fusion dequantizes each weight to fp32 and re-quantizes it through a dozen full-size passes.
`ltx_mgpu.fp8.triton_lora` reads the e4m3 bytes twice and writes them once. This times both per weight shape of
the 19B block (4096x4096, 4096x16384 and 16384x4096 as (out, in)) and LoRA rank, and reports the share of the
fused weights' bytes that differ (none expected: the same deltas, the same fp32 arithmetic: `triton_lora`).

Output: JSON lines, then one line starting with "SUMMARY" with the kernels' speed over the eager fusion and an
estimate for one 19B swap of the rank-384 distilled LoRA (each shape's time times how often the transformer has
it: `DEFAULT_SHAPES`).

    python -m bench.fp8_lora                                 # one H200, seconds
    python -m bench.fp8_lora --device cpu --shapes 96x200 --ranks 16 --iters 1   # smoke check (eager only)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import emit, emit_summary
from ltx_mgpu.fp8.lora import fuse_rowwise_eager
from ltx_mgpu.fp8.rowwise import quantize_weight, triton_available

#: (out, in) of the 19B block's LoRA-able linears and how many of each one block has (video and audio attention
#: projections, feed-forward up and down; the audio widths are smaller and counted as video-sized: an upper bound)
DEFAULT_SHAPES = {"4096x4096": 16, "16384x4096": 2, "4096x16384": 2}
BLOCKS_19B = 48
DISTILLED_RANK = 384  #: the published distilled LoRA's rank: the swap the two-stage runner makes per render


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Any, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / max(1, iters) * 1000.0


def _case(shape: str, rank: int, device: torch.device, gen: torch.Generator, args: argparse.Namespace,
          kernels: bool) -> dict[str, Any]:  # fmt: skip
    """One weight shape and LoRA rank: eager and (on CUDA) kernel times, and how far their results differ."""
    n, k = (int(x) for x in shape.split("x"))
    q, s = quantize_weight((torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16))
    a = (torch.randn(rank, k, generator=gen, device=device) * 0.01).to(torch.bfloat16)
    b = (torch.randn(n, rank, generator=gen, device=device) * 0.01).to(torch.bfloat16)
    factors = [(a, b, 1.0)]
    row: dict[str, Any] = {"kind": "fuse", "shape": shape, "rank": rank}
    row["eager_ms"] = round(_time(lambda: fuse_rowwise_eager(q, s, factors), device, args.iters, args.warmup), 4)
    if kernels:
        from ltx_mgpu.fp8.triton_lora import fuse_rowwise_triton

        row["triton_ms"] = round(_time(lambda: fuse_rowwise_triton(q, s, factors), device, args.iters,
                                       args.warmup), 4)  # fmt: skip
        (qe, se), (qt, st) = fuse_rowwise_eager(q, s, factors), fuse_rowwise_triton(q, s, factors)
        row["bytes_differing"] = int((qe.view(torch.uint8) != qt.view(torch.uint8)).sum().item())  # (expect 0)
        row["scales_equal"] = bool(torch.equal(se, st))
        row["speedup"] = round(row["eager_ms"] / row["triton_ms"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="NxK weight shapes (out x in)")
    ap.add_argument("--ranks", default="32,128,384", help="LoRA ranks")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    kernels = device.type == "cuda" and triton_available()
    emit({"kind": "meta", "device": str(device), "torch": torch.__version__, "kernels": kernels,
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    speedups: dict[str, float] = {}
    swap_ms = {"eager": 0.0, "triton": 0.0}
    for shape in args.shapes.split(","):
        for rank in (int(r) for r in args.ranks.split(",")):
            row = _case(shape, rank, device, gen, args, kernels)
            if "speedup" in row:
                speedups[f"{shape}:r{rank}"] = row["speedup"]
            count = DEFAULT_SHAPES.get(shape, 0) * BLOCKS_19B
            if rank == DISTILLED_RANK and count:
                swap_ms["eager"] += row["eager_ms"] * count
                swap_ms["triton"] += row.get("triton_ms", 0.0) * count
            emit(row)
    estimate = {key: round(value / 1000.0, 3) for key, value in swap_ms.items()}
    summary = {"speedup_triton_over_eager": speedups, f"est_19b_swap_rank{DISTILLED_RANK}_s": estimate,
               "kernels": kernels, "device": str(device)}  # fmt: skip
    emit_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
