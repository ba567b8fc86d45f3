"""Time one LTX-2 transformer block at the real 19B dimensions on one GPU and project what sequence
parallelism over W GPUs would do with it.

Workload: one ltx-core `BasicAVTransformerBlock` (video 32 heads x 128 = 4096 wide, audio 32 x 64 = 2048
wide, text context 4096/2048, random bf16 weights), video token counts 6k / 24k / 32k (LTX-2 stage 1 at
512x768x121, full resolution 1024x1536x121, and ~1920x1088x121), 126 audio tokens (121 frames at 24 fps),
batch 1, unmasked attention (torch SDPA picks its flash kernel on Hopper).

Measured per token count (CUDA events, after warm-up; no synchronisation inside the timed region):
- block_ms: the whole block (video + audio + both audio-video cross-attentions);
- attention_ms by kind (video self, video->text, audio self, audio->text, audio->video, video->audio) and
  other_ms = block_ms - all attention;
- audio_only_ms: the block with only the audio stream (what SP replicates on every rank).

Derived per world size W (2, 4, 8):
- all2all bytes per block and rank: attn1 exchanges q, k, v and the output (4 x T/W x 4096 x 2 B, of
  which (W-1)/W leaves the rank), video->audio exchanges k, v at audio width (2 x T/W x 2048 x 2 B,
  (W-1)/W leaves) and all-gathers the audio output (126 x 2048/W x 2 B to each of W-1 peers);
- projected block time = (block - audio_only)/W + audio_only + bytes/link, with the link at
  --link-gbps (450 GB/s: NVLink 4 per-GPU unidirectional line rate) times --link-efficiency;
- projected speedup = block / projected.
It is a projection from one GPU (perfect division of the video work, no overlap of communication with
compute, no kernel-efficiency loss at smaller per-rank shapes): an upper bound to check real runs against.

Output: one JSON object per line ("kind": "measure" per token count, "projection" per token count and W),
then one line starting with "SUMMARY".

    python -m bench.sp_block                       # H200 defaults
    python -m bench.sp_block --device cpu --dims tiny --tokens 96,192 --iters 2   # smoke check anywhere
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.block import DIMS, block_config, block_inputs, build_block
from bench.common import emit, time_ms

ATTENTION_KINDS = {
    "attn1": "video_self",
    "attn2": "video_text",
    "audio_attn1": "audio_self",
    "audio_attn2": "audio_text",
    "audio_to_video_attn": "audio_to_video",
    "video_to_audio_attn": "video_to_audio",
}


class _EventTimer:
    """Wraps attention callables to record CUDA events around each call (no host synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.enabled = False

    def wrap(self, kind: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            if not self.enabled:
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                end = time.perf_counter()
            self.events[kind].append((start, end))
            return out

        return timed

    def totals_ms(self, iters: int) -> dict[str, float]:
        out = {}
        for kind, pairs in self.events.items():
            if self.cuda:
                total = sum(s.elapsedtime_ms(e) for s, e in pairs)
            else:
                total = sum((e - s) * 1e3 for s, e in pairs)
            out[kind] = total / iters
        return out


def all2all_bytes_per_block(
    tokens: int, world: int, dims: dict[str, int], audio_tokens: int, elem: int = 2
) -> dict[str, float]:
    """Bytes one rank sends per block (what crosses the links; it receives the same amount)."""
    video_hidden = dims["heads"] * dims["head_dim"]
    audio_hidden = dims["audio_heads"] * dims["audio_head_dim"]
    local = math.ceil(tokens / world)
    leave = (world - 1) / world
    attn1 = 4 * local * video_hidden * elem * leave  # q, k, v out; heads back
    v2a_kv = 2 * local * audio_hidden * elem * leave  # k, v at audio width
    v2a_out = audio_tokens * (audio_hidden // world) * elem * (world - 1)  # all-gather of the audio output
    return {
        "attn1": attn1,
        "video_to_audio_kv": v2a_kv,
        "video_to_audio_out": v2a_out,
        "total": attn1 + v2a_kv + v2a_out,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dims", choices=sorted(DIMS), default="19b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", default="6144,24576,32768", help="comma-separated video token counts")
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=450.0, help="per-GPU unidirectional link GB/s")
    parser.add_argument("--link-efficiency", type=float, default=0.8, help="fraction of the link achieved")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    dims = DIMS[args.dims]
    cfg = block_config(dims)
    model = build_block(cfg, device, dtype)
    block = model.transformer_blocks[0]
    timer = _EventTimer(device)
    for name, kind in ATTENTION_KINDS.items():
        attn = getattr(block, name)
        attn.attention_function = timer.wrap(kind, attn.attention_function)
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    pert = BatchedPerturbationConfig.empty(1)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "dims": args.dims,
        "block_params_M": round(sum(p.numel() for p in block.parameters()) / 1e6, 1),
    }
    emit({"kind": "env", **env})

    summary = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        vargs, aargs, vonly, aonly = block_inputs(model, cfg, tokens, device, dtype)
        with torch.no_grad():
            timer.enabled = False
            full = functools.partial(block, vargs, aargs, pert)
            block_ms = time_ms(full, device, args.iters, args.warmup)
            audio_only_ms = time_ms(functools.partial(block, None, aonly, pert), device, args.iters, args.warmup)
            video_only_ms = time_ms(functools.partial(block, vonly, None, pert), device, args.iters, args.warmup)
            timer.events.clear()
            timer.enabled = True
            time_ms(full, device, args.iters, 0)
            timer.enabled = False
        attention = timer.totals_ms(args.iters)
        attention_ms = sum(attention.values())
        measure = {
            "kind": "measure",
            "video_tokens": tokens,
            "audio_tokens": aargs.x.shape[1],
            "block_ms": round(block_ms, 3),
            "attention_ms": round(attention_ms, 3),
            "other_ms": round(block_ms - attention_ms, 3),
            "attention_share": round(attention_ms / block_ms, 3),
            "attention_by_kind_ms": {k: round(v, 3) for k, v in sorted(attention.items())},
            "video_only_ms": round(video_only_ms, 3),
            "audio_only_ms": round(audio_only_ms, 3),
        }
        emit(measure)
        link = args.link_gbps * 1e9 * args.link_efficiency
        for world in (int(w) for w in args.worlds.split(",")):
            nbytes = all2all_bytes_per_block(tokens, world, dims, aargs.x.shape[1], dtype.itemsize)
            comm_ms = nbytes["total"] / link * 1e3
            compute_ms = (block_ms - audio_only_ms) / world + audio_only_ms
            projected = compute_ms + comm_ms
            row = {
                "kind": "projection",
                "video_tokens": tokens,
                "world_size": world,
                "all2all_bytes_per_rank": {k: int(v) for k, v in nbytes.items()},
                "all2all_MB_per_rank": round(nbytes["total"] / 2**20, 2),
                "comm_ms": round(comm_ms, 3),
                "compute_ms": round(compute_ms, 3),
                "projected_block_ms": round(projected, 3),
                "projected_speedup": round(block_ms / projected, 2),
                "link_GBps_assumed": round(link / 1e9, 1),
            }
            emit(row)
            if world == max(int(w) for w in args.worlds.split(",")):
                summary.append(
                    f"{tokens} tokens: block {block_ms:.2f} ms (attention {100 * attention_ms / block_ms:.0f}%), "
                    f"W={world}: {row['all2all_MB_per_rank']} MB/rank/block, speedup ~{row['projected_speedup']}x"
                )
    print(
        "SUMMARY "
        + " | ".join(summary)
        + f" | {env['device']}, {args.dtype}, link {args.link_gbps} GB/s x {args.link_efficiency}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
