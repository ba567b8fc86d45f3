"""torch's scaled-dot-product attention backends side by side at LTX-2's attention shapes, in one run.

Why: at 24,576 video tokens (1536x1024x121) attention is ~43% of a transformer block's FLOPs and, at the
flash backend's rate, more than half of the block's time; which backend torch picks by default is not the
fastest one on Hopper for every shape. This measures, per shape and backend (`flash`, `cudnn`,
`efficient`), ms per call from CUDA-graph replays (as the runners call it) and eager, the TFLOP/s it
reaches, and its difference from a float32 reference (the math backend in fp32 where it fits in memory,
else the flash backend's bf16 output), so a backend is chosen by measurement and its numerics are known.

Shapes (LTX-2 19B: video 32 heads x 128, audio 32 x 64): video self-attention at 1,536 / 6,144 / 24,576
tokens, batch 1 and 2 (CFG's two passes batched on one GPU), laid out as ltx-core lays them out
(`[B, T, H*D]` viewed and transposed to `[B, H, T, D]`: not contiguous); `--shapes` takes more.
Output: JSON lines, then one line starting with "SUMMARY" with each backend's speed over the default's.

    python bench/attention.py                       # one H200, ~30 s
    python bench/attention.py --device cpu --shapes 1x256x4x32 --iters 1 --warmup 0   # smoke check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8 import _graph
from sp_block import _time

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
DEFAULT_SHAPES = ("1x1536x32x128", "2x1536x32x128", "1x6144x32x128", "2x6144x32x128", "1x24576x32x128",
                  "2x24576x32x128")  # fmt: skip
#: the float32 math reference materialises B*H*T*T scores: beyond this many bytes the flash output is the reference
REFERENCE_LIMIT_BYTES = 12 * 2**30


def _shape(text: str) -> tuple[int, int, int, int]:
    b, t, h, d = (int(x) for x in text.lower().split("x"))
    return b, t, h, d


def _qkv(b: int, t: int, h: int, d: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v as ltx-core hands them to SDPA: `[B, T, H*D]` viewed as `[B, H, T, D]` (strided), with
    activations of unit scale (LTX-2's q/k are RMS-normed before attention)."""
    gen = torch.Generator(device="cpu").manual_seed(1234 + t)
    return [torch.randn(b, t, h * d, generator=gen).to(device, dtype).view(b, t, h, d).transpose(1, 2)
            for _ in range(3)]  # fmt: skip


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, str]:
    b, h, t, _ = q.shape
    if b * h * t * k.shape[2] * 4 * 2 <= REFERENCE_LIMIT_BYTES or q.device.type == "cpu":
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float()), "math_fp32"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v).float(), "flash_bf16"


def measure(
    shape: tuple[int, int, int, int],
    backends: list[str],
    device: torch.device,
    dtype: torch.dtype,
    iters: int,
    warmup: int,
) -> list[dict[str, Any]]:
    b, t, h, d = shape
    q, k, v = _qkv(b, t, h, d, device, dtype)
    flops = 4.0 * b * h * t * t * d
    ref, ref_kind = _reference(q, k, v)
    rows: list[dict[str, Any]] = []
    for name in ["default", *backends]:
        row: dict[str, Any] = {"kind": "sdpa", "shape": f"{b}x{t}x{h}x{d}", "backend": name}

        def call(name: str = name) -> torch.Tensor:
            if name == "default":
                return F.scaled_dot_product_attention(q, k, v)
            with sdpa_kernel([BACKENDS[name]]):
                return F.scaled_dot_product_attention(q, k, v)

        try:
            out = call()
        except RuntimeError as exc:  # the backend refuses this shape, dtype or device
            row["unsupported"] = str(exc).splitlines()[0][:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        err = (out.float() - ref).norm() / ref.norm()
        row.update(rel_err=float(err), reference=ref_kind,
                   eager_ms=_time(call, device, iters, warmup))  # fmt: skip
        replay, captured = _graph(call, device)  # (eager where capture failed: fp8.py prints why)
        if captured is not None:
            row["graph_ms"] = _time(replay, device, iters, warmup)
        best = row.get("graph_ms", row["eager_ms"])
        row["tflops"] = flops / (best * 1e-3) / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="BxTxHxD, comma separated")
    parser.add_argument("--backends", default="flash,cudnn,efficient")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backends = [x for x in args.backends.split(",") if x]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {sorted(BACKENDS)}")
    meta = {"kind": "meta", "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(device), cudnn=torch.backends.cudnn.version())
    print(json.dumps(meta), flush=True)
    summary: dict[str, Any] = {"speedup_over_default": {}, "rel_err": {}}
    for text in args.shapes.split(","):
        rows = measure(_shape(text), backends, device, dtype, args.iters, args.warmup)
        base = next((r for r in rows if r["backend"] == "default" and "tflops" in r), None)
        for r in rows:
            if base is None or "tflops" not in r or r["backend"] == "default":
                continue
            summary["speedup_over_default"][f"{r['shape']}:{r['backend']}"] = round(r["tflops"] / base["tflops"], 3)
            summary["rel_err"][f"{r['shape']}:{r['backend']}"] = float(f"{r['rel_err']:.3g}")
        if base is not None:
            summary["rel_err"][f"{base['shape']}:default"] = float(f"{base['rel_err']:.3g}")
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
