"""One ltx-core transformer block, bf16 against `fp8-mm` against `fp8-mm+attn` (FP8 linears and FP8 video
self-attention; also without the attention's value shift, `_unshifted`; with `--fused`, `fp8-mm+attn` with its
norms, modulation, gated residuals and split RoPE in Triton kernels, `_fused`), at 1,536 / 6,144 / 24,576 video
tokens: ms per call (timed with CUDA events over graph replays after warm-up, `bench.common.time_ms`; wall
clock on the CPU) and the relative
error of each against bf16 (video output and the video update out - x). Built on bench/block.py's block
harness (imported, not changed); needs ltx-core (the GPU host's `wheels` phase) and, on CUDA, the cuDNN
frontend (`.whl3/`). Every variant runs in a try/except that records its error as a JSON line.

    python -m bench.fp8_attn_block                                  # one H200
    python -m bench.fp8_attn_block --fused --tokens 6144,24576       # plus the fused-elementwise candidate

Each token count runs twice by default (`--timesteps both`): with one timestep per token, as ltx-core's
pipelines call the blocks, and with one for all tokens, as the runners do for a job without conditioning; the
second row also gives each variant's speed-up against the first row's bf16 block.
    python -m bench.fp8_attn_block --device cpu --dims tiny --tokens 96 --iters 1 --warmup 0   # smoke
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.block import DIMS, BlockCase, block_outputs
from bench.common import cuda_graph, emit, rel_err, time_ms
from ltx_mgpu.fp8.attention import install_fp8_attention


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dims", choices=sorted(DIMS), default="19b")
    ap.add_argument("--tokens", default="1536,6144,24576")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fused", action="store_true", help="also fp8-mm+attn with fused elementwise kernels")
    ap.add_argument(
        "--timesteps",
        choices=("per-token", "one", "both"),
        default="both",
        help="the blocks' timesteps: one per token (ltx-core's pipelines), one for all tokens (the runners "
        "without conditioning), or both, each row against the bf16 block on the same inputs",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    case = BlockCase("ltx", DIMS[args.dims], device)
    # only_converted=False: the harness's block is block 0 of its model, which the recipe would keep bf16
    holder = torch.nn.Module()
    holder.transformer_blocks = torch.nn.ModuleList([copy.deepcopy(case.fp8)])
    attn = install_fp8_attention(holder, only_converted=False).transformer_blocks[0]
    unshifted = torch.nn.Module()  # the same without the value shift, to measure what it saves in the same run
    unshifted.transformer_blocks = torch.nn.ModuleList([copy.deepcopy(case.fp8)])
    unshifted = install_fp8_attention(unshifted, only_converted=False, smooth_v=False).transformer_blocks[0]
    variants = [("bf16", case.bf16), ("fp8_mm", case.fp8), ("fp8_mm_attn", attn), ("fp8_mm_attn_unshifted", unshifted)]
    if args.fused:  # the faster-block candidate: the FP8 attention and linears plus the fused elementwise work
        from ltx_mgpu.fused.block import fuse_elementwise

        fused = copy.deepcopy(attn)
        if not fuse_elementwise(fused):
            raise SystemExit("--fused: no module of the block took the fused forward")
        variants.append(("fp8_mm_attn_fused", fused))
    compared = [name for name, _ in variants if name != "bf16"]
    summary = []
    modes = ("per-token", "one") if args.timesteps == "both" else (args.timesteps,)
    bf16_per_token: dict[int, float] = {}
    for tokens, mode in ((int(t), m) for t in args.tokens.split(",") for m in modes):
        vargs, aargs, pert = case.ltx_args(tokens, one_timestep=mode == "one")
        with torch.no_grad():
            ref_v, _ = block_outputs(case.bf16(vargs, aargs, pert))
        row = {"kind": "block", "video_tokens": tokens, "timesteps": mode}
        for name, block in variants:
            try:
                with torch.no_grad():
                    out_v, _ = block_outputs(block(vargs, aargs, pert))  # (eager first: cuDNN builds its graph)
                    run = cuda_graph(lambda b=block: b(vargs, aargs, pert), device)[0]  # noqa: B023
                    row[f"{name}_ms"] = round(time_ms(run, device, args.iters, args.warmup), 3)
                row[f"{name}_rel_err_video"] = rel_err(out_v, ref_v)
                row[f"{name}_rel_err_video_update"] = rel_err(out_v - vargs.x, ref_v - vargs.x)
            except Exception as exc:  # one shot on the GPU: record and go on
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        for name in compared:
            if f"{name}_ms" in row and "bf16_ms" in row:
                row[f"{name}_speedup"] = round(row["bf16_ms"] / row[f"{name}_ms"], 3)
        if mode == "per-token" and "bf16_ms" in row:
            bf16_per_token[tokens] = row["bf16_ms"]
        elif tokens in bf16_per_token:  # what one timestep saves, against the per-token bf16 block of this run
            for name, _ in variants:
                if f"{name}_ms" in row:
                    row[f"{name}_speedup_vs_per_token_bf16"] = round(bf16_per_token[tokens] / row[f"{name}_ms"], 3)
        emit(row)
        summary.append(
            f"{tokens} (timesteps: {mode}): fp8-mm {row.get('fp8_mm_speedup')}x, "
            f"fp8-mm+attn {row.get('fp8_mm_attn_speedup')}x "
            f"(err {row.get('fp8_mm_attn_rel_err_video')}; unshifted {row.get('fp8_mm_attn_unshifted_speedup')}x, "
            f"err {row.get('fp8_mm_attn_unshifted_rel_err_video')})"
            + (
                f", fused {row.get('fp8_mm_attn_fused_speedup')}x (err {row.get('fp8_mm_attn_fused_rel_err_video')})"
                if args.fused
                else ""
            )
        )
    print("SUMMARY block speedups over bf16 | " + " | ".join(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
