"""torch's scaled-dot-product attention backends side by side at LTX-2's attention shapes, in one run.

Why: at 24,576 video tokens (1536x1024x121) attention is ~43% of a transformer block's FLOPs and, at the
flash backend's rate, more than half of the block's time; which backend torch picks by default is not the
fastest one on Hopper for every shape. This measures, per shape and backend (`flash`, `cudnn`,
`efficient`), ms per call from CUDA-graph replays (as the runners call it) and eager, the TFLOP/s it
reaches, and its difference from a float32 reference (the math backend in fp32 where it fits in memory,
else the flash backend's bf16 output), so a backend is chosen by measurement and its numerics are known.

Shapes (LTX-2 19B: video 32 heads x 128, audio 32 x 64): video self-attention at 1,536 / 6,144 / 24,576 /
47,616 tokens (47,616: 1536x1024x121 less one latent frame, the largest render), batch 1 and 2 (CFG's two
passes batched on one GPU), laid out as ltx-core lays them out (`[B, T, H*D]` viewed and transposed to
`[B, H, T, D]`: not contiguous); `--shapes` takes more. The float32 reference is computed over every query
where B*H*T*T fits `REFERENCE_LIMIT_BYTES`, else over 1,024 evenly spaced queries (all keys).

Candidates beyond torch's bf16 backends (`--candidates`; rows of kind "candidate"), each run inside a
try/except that records its error as a JSON line and moves on, and skipped with the reason when its library
or GPU is missing:
- `cudnn-fp8`: `ltx_mgpu.fp8.attention.Fp8SelfAttention` on cuDNN's FP8 SDPA (nvidia-cudnn-frontend), the
  whole call as a model makes it (`ms`: q/k/v amax and e4m3 casts, the kernel, O back to bf16; amax for q
  and k too, the runners take theirs from the RMSNorm weights instead), and its parts: `kernel_ms` (SDPA on
  quantized inputs), `quantize_ms` (scales and casts), `dequantize_ms`;
- `sage-int8`: SageAttention 1.0.6 (INT8 Q.K^T per block, fp16 P.V; bf16 in and out);
- `fp8-emulate`: the CPU emulation of `cudnn-fp8` (same roundings, fp32 arithmetic; the CI smoke check).
Output: JSON lines, then one line starting with "SUMMARY" with each backend's speed over the default's and
each candidate's over torch's bf16 cuDNN backend (`speedup_over_cudnn_bf16`).

    python -m bench.attention                       # one H200, ~1 min
    python -m bench.attention --device cpu --shapes 1x256x4x32 --iters 1 --warmup 0 --candidates fp8-emulate
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import cuda_graph, emit, emit_summary, time_ms

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
DEFAULT_SHAPES = ("1x1536x32x128", "2x1536x32x128", "1x6144x32x128", "2x6144x32x128", "1x24576x32x128",
                  "1x47616x32x128")  # fmt: skip
CANDIDATES = ("cudnn-fp8", "sage-int8", "fp8-emulate")
REFERENCE_ROWS = 1024  #: queries of the float32 reference where the whole product does not fit
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


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """(float32 attention, its kind, the query rows it covers: None for all)."""
    b, h, t, _ = q.shape
    rows = None
    if b * h * t * k.shape[2] * 4 * 2 > REFERENCE_LIMIT_BYTES and q.device.type != "cpu":
        rows = torch.linspace(0, t - 1, REFERENCE_ROWS, device=q.device).round().long()
        q = q[:, :, rows]
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return out, "math_fp32" if rows is None else f"math_fp32_{REFERENCE_ROWS}_rows", rows


def _rel_err(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> float:
    """Relative Frobenius error of `out` (B, H, T, D) against the reference (on its rows)."""
    out = out.float() if rows is None else out[:, :, rows].float()
    return float((out - ref).norm() / ref.norm())


def measure(
    shape: tuple[int, int, int, int],
    backends: list[str],
    device: torch.device,
    dtype: torch.dtype,
    iters: int,
    warmup: int,
    candidates: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    b, t, h, d = shape
    q, k, v = _qkv(b, t, h, d, device, dtype)
    flops = 4.0 * b * h * t * t * d
    ref, ref_kind, ref_rows = _reference(q, k, v)
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
            emit(row)
            continue
        row.update(rel_err=_rel_err(out, ref, ref_rows), reference=ref_kind,
                   eager_ms=time_ms(call, device, iters, warmup))  # fmt: skip
        replay, captured = cuda_graph(call, device)  # (eager where capture failed: a note line says why)
        if captured is not None:
            row["graph_ms"] = time_ms(replay, device, iters, warmup)
        best = row.get("graph_ms", row["eager_ms"])
        row["tflops"] = flops / (best * 1e-3) / 1e12
        rows.append(row)
        emit(row)
    for name in candidates:
        row = {"kind": "candidate", "shape": f"{b}x{t}x{h}x{d}", "backend": name}
        try:  # one shot on the GPU: whatever a candidate raises is a row, and the next one runs
            _candidate(name, row, q, k, v, (ref, ref_kind, ref_rows), flops, iters, warmup)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        rows.append(row)
        emit(row)
    return rows


def _candidate(
    name: str, row: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reference: tuple[Any, ...],
    flops: float, iters: int, warmup: int,
) -> None:  # fmt: skip
    """Fill `row` for candidate `name` on q, k, v ([B, H, T, D] views of ltx-core's [B, T, H*D])."""
    from ltx_mgpu.fp8 import attention as fa

    device = q.device
    b, h, t, d = q.shape
    q3, k3, v3 = (x.transpose(1, 2).reshape(b, t, h * d) for x in (q, k, v))  # views: ltx-core's layout
    backend = {"cudnn-fp8": "cudnn", "sage-int8": "sage", "fp8-emulate": "emulate"}[name]
    why = fa.fp8_attention_support(device, backend)
    if why is not None:
        row["unsupported"] = why
        return
    attn = fa.Fp8SelfAttention(None, backend=backend)

    def call() -> torch.Tensor:
        return attn(q3, k3, v3, h)

    out = call()
    ref, ref_kind, ref_rows = reference
    row.update(rel_err=_rel_err(out.view(b, t, h, d).transpose(1, 2), ref, ref_rows), reference=ref_kind)
    row["eager_ms"] = time_ms(call, device, iters, warmup)
    replay, captured = cuda_graph(call, device)
    if captured is not None:
        row["graph_ms"] = time_ms(replay, device, iters, warmup)
        row["graph_equals_eager"] = bool(torch.equal(captured, call()))
    best = row.get("graph_ms", row["eager_ms"])
    row["tflops"] = flops / (best * 1e-3) / 1e12
    if backend != "cudnn":
        return
    from ltx_mgpu.fp8.cudnn_attention import cudnn_fp8_sdpa

    scales, inv = fa.attention_scales(q3, k3, v3, None, None)
    q8, k8, v8 = (fa.quantize(x, inv[i]).view(b, t, h, d) for i, x in enumerate((q3, k3, v3)))
    o8 = cudnn_fp8_sdpa(q8, k8, v8, scales)
    parts = {
        "kernel_ms": lambda: cudnn_fp8_sdpa(q8, k8, v8, scales),
        "quantize_ms": lambda: (
            [fa.quantize(x, inv[i]) for i, x in enumerate((q3, k3, v3))] + [fa.attention_scales(q3, k3, v3, None, None)]
        ),
        "v_amax_ms": lambda: fa.attention_scales(q3, k3, v3, scales[0], scales[1]),  # what the runners add
        "dequantize_ms": lambda: fa.dequantize(o8, scales[2], q3.dtype),
    }
    for key, fn in parts.items():
        run, captured = cuda_graph(fn, device)
        row[key] = time_ms(run, device, iters, warmup)
    row["kernel_tflops"] = flops / (row["kernel_ms"] * 1e-3) / 1e12


def _versions() -> dict[str, str]:
    """The candidates' libraries as installed ("absent" where they do not import)."""
    from importlib import metadata

    found = {}
    for dist in ("nvidia-cudnn-frontend", "sageattention", "triton"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="BxTxHxD, comma separated")
    parser.add_argument("--backends", default="flash,cudnn,efficient")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--candidates", default="cudnn-fp8,sage-int8",
                        help=f"comma list of {', '.join(CANDIDATES)} ('' for none)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backends = [x for x in args.backends.split(",") if x]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {sorted(BACKENDS)}")
    candidates = tuple(x for x in args.candidates.split(",") if x)
    if set(candidates) - set(CANDIDATES):
        parser.error(f"unknown candidates {sorted(set(candidates) - set(CANDIDATES))}; choose from {CANDIDATES}")
    meta = {"kind": "meta", "torch": torch.__version__, "device": str(device), "libraries": _versions()}
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(device), cudnn=torch.backends.cudnn.version())
    emit(meta)
    summary: dict[str, Any] = {"speedup_over_default": {}, "rel_err": {}, "speedup_over_cudnn_bf16": {}}
    for text in args.shapes.split(","):
        rows = measure(_shape(text), backends, device, dtype, args.iters, args.warmup, candidates)
        base = next((r for r in rows if r["backend"] == "default" and "tflops" in r), None)
        cudnn_bf16 = next((r for r in rows if r["kind"] == "sdpa" and r["backend"] == "cudnn" and "tflops" in r), None)
        for r in rows:
            if cudnn_bf16 is not None and r["kind"] == "candidate" and "tflops" in r:
                key = f"{r['shape']}:{r['backend']}"
                summary["speedup_over_cudnn_bf16"][key] = round(r["tflops"] / cudnn_bf16["tflops"], 3)
                if "kernel_tflops" in r:
                    ratio = r["kernel_tflops"] / cudnn_bf16["tflops"]
                    summary["speedup_over_cudnn_bf16"][key + "(kernel)"] = round(ratio, 3)
            if base is None or "tflops" not in r or r["backend"] == "default":
                continue
            summary["speedup_over_default"][f"{r['shape']}:{r['backend']}"] = round(r["tflops"] / base["tflops"], 3)
            summary["rel_err"][f"{r['shape']}:{r['backend']}"] = float(f"{r['rel_err']:.3g}")
        if base is not None:
            summary["rel_err"][f"{base['shape']}:default"] = float(f"{base['rel_err']:.3g}")
    emit_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
