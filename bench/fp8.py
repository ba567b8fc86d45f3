"""bf16 against FP8 (`quantization="fp8-mm"`, `ltx_mgpu.fp8`) side by side in one run, on one GPU, with
synthetic weights at the 19B dimensions.

Measured per video token count (1,536 / 6,144 / 24,576: a 768x512x121 latent over 4 ranks, 768x512x121,
1536x1024x121), CUDA events after warm-up, each callable replayed from a CUDA graph as the runners run
their denoising forwards (`--no-graphs`: eager; the linears and the block also report eager times):
- "gemm": each linear shape of the block (4096->4096, 4096->16384, 16384->4096), bf16 `F.linear` against
  `Fp8Linear` with its per-token activation quantization included (`fp8_ms`), and its parts (`quant_ms`: the
  Triton quantization alone, `fp8_gemm_ms`: `torch._scaled_mm` on a quantized input);
- "linears": every video-token-sized linear of one block, called as the block calls them: self-attention
  q/k/v (one shared quantization) and out, text cross-attention q and out, audio->video q and out,
  video->audio k/v, and the feed-forward with its GELU (bf16: GELU in eager torch; fp8: fused into the
  down projection's quantization). Target: >= 1.5x at 6,144 and 24,576 tokens;
- "block": one whole `BasicAVTransformerBlock` (video + 126 audio tokens, attention in bf16) with the same
  weights, bf16 against fp8 (the recipe converts every Linear of a middle block); where ltx-core is not
  installed (the GPU hosts' bare image) a synthetic stand-in (`bench/fp8_standin.py`: the same linears and call
  pattern, modulated norms and bf16 SDPA, no RoPE, no audio self path); also its relative error
  against bf16 (video and audio outputs, and the video update out - x, which in bf16 also carries the
  output's own rounding of x + update: tests/test_fp8_numerics.py measures the update in fp32). Targets:
  >= 1.4x at 6,144, >= 1.25x at 24,576; error <= 3%;
- "fused" (`--fused`, ltx-core's block only): the same block with its elementwise work in Triton kernels
  (`ltx_mgpu.fused`), bf16 and fp8: `bf16_fused_ms`, `fp8_fused_ms`, each one's ratio to the bf16 block and
  its relative error against the bf16 eager block (targets: bf16 fused >= 1.15x; fp8 fused >= 1.6x at 6,144,
  >= 1.8x at 24,576; error <= 3%);
- "check": the Triton quantization against the eager definition, bit for bit; the GEMM path against the
  emulation (bf16 output rounding apart); the fp8 block replayed from a CUDA graph against its eager run.
Output: JSON lines, then one line starting with "SUMMARY" with the ratios.

    python -m bench.fp8                                  # one H200, ~40 s
    python -m bench.fp8 --tokens 6144,24576 --kernels 12  # plus device time by kernel family and the top 12
    python -m bench.fp8 --fused --kernels 12             # plus the fused blocks (needs ltx-core)
    python -m bench.fp8 --device cpu --dims tiny --tokens 96,192 --iters 1 --warmup 0   # smoke check (CI)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from bench.block import DIMS, BlockCase, activation, block_outputs
from bench.common import cuda_graph, emit, ltx_core_available, rel_err, time_ms
from ltx_mgpu.fp8 import Fp8Linear, quantize_rows, quantize_rows_eager, quantize_weight
from ltx_mgpu.fp8.linear import emulated_gemm, fp8_gemm


def _measure(fn: Any, device: torch.device, args: Any) -> float:
    """ms per call: graph replays unless --no-graphs (eager launches cost ~10-30 us a linear on the host)."""
    run = cuda_graph(fn, device)[0] if args.graphs else fn
    return time_ms(run, device, args.iters, args.warmup)


#: kernel families by name, first match wins (cuBLAS/CUTLASS GEMMs, flash/SDPA attention, our Triton
#: quantization, then torch's reductions/norms and elementwise kernels)
FAMILIES = (("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")), ("attention", ("flash", "fmha", "attention")),
            ("fp8_quantize", ("quantize", "triton")), ("reduce_norm", ("reduce", "norm")),
            ("elementwise", ("elementwise", "vectorized", "unrolled", "copy")))  # fmt: skip


def kernel_profile(fn: Any, top: int) -> dict[str, Any]:
    """Device time of one eager call by kernel family and its `top` kernels (torch.profiler's CUDA kernel
    records: GPU time, not launch overhead), after one unprofiled call; what the block spends outside its
    GEMMs and attention is what fusion could take away."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time / 1000
    families: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        family = next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")
        families[family] = families.get(family, 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"total_ms": round(sum(kernels.values()), 3), "families_ms": {k: round(v, 3) for k, v in families.items()},
            "top": [{"ms": round(ms, 3), "kernel": name[:120]} for name, ms in ranked]}  # fmt: skip


def _tflops(m: int, k: int, n: int, ms: float) -> float:
    return round(2 * m * k * n / (ms * 1e-3) / 1e12, 1)


def _gemms(tokens: int, width: int, device: torch.device, args: Any) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for k, n in ((width, width), (width, 4 * width), (4 * width, width)):
        lin = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(lin).load_from(lin)
        x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
        q, s = quantize_rows(x)
        with torch.no_grad():
            bf16_ms = _measure(lambda: F.linear(x, lin.weight, lin.bias), device, args)  # noqa: B023
            fp8_ms = _measure(lambda: fp8(x), device, args)  # noqa: B023
            quant_ms = _measure(lambda: quantize_rows(x), device, args)  # noqa: B023
            gemm_ms = _measure(lambda: fp8_gemm(q, s, fp8.weight, fp8.weight_scale, fp8.bias, x.dtype), device, args)  # noqa: B023
        rows.append({
            "kind": "gemm", "video_tokens": tokens, "shape": f"{k}x{n}", "bf16_ms": round(bf16_ms, 4),
            "fp8_ms": round(fp8_ms, 4), "quant_ms": round(quant_ms, 4), "fp8_gemm_ms": round(gemm_ms, 4),
            "bf16_tflops": _tflops(tokens, k, n, bf16_ms), "fp8_gemm_tflops": _tflops(tokens, k, n, gemm_ms),
            "speedup": round(bf16_ms / fp8_ms, 3),
        })  # fmt: skip
    return rows


def _linears(block: torch.nn.Module, x: torch.Tensor, attn_out: torch.Tensor, a2v_out: torch.Tensor,
             ctx: torch.Tensor) -> None:  # fmt: skip
    """The video-token-sized linears of one block, in the block's own call pattern."""
    a1, a2, av, va = block.attn1, block.attn2, block.audio_to_video_attn, block.video_to_audio_attn
    a1.to_v(x), a1.to_q(x), a1.to_k(x)
    a1.to_out(attn_out)
    a2.to_v(ctx), a2.to_q(x), a2.to_k(ctx)
    a2.to_out(attn_out)
    av.to_q(x)
    av.to_out(a2v_out)
    va.to_v(x), va.to_k(x)
    share = getattr(va.to_out[0], "share", None)  # video->audio's output projection is audio-sized: end it here
    if share is not None:
        share.clear()
    block.ff(x)


def _fused_row(case: BlockCase, tokens: int, blk_bf16: float, ref_v: torch.Tensor, ref_a: torch.Tensor,
               device: torch.device, args: Any) -> dict[str, Any]:  # fmt: skip
    """The fused bf16 and fp8 blocks at `tokens`: time (graph replays), ratio to the bf16 block, error against
    the bf16 eager block, and the graph replay against the eager call."""
    vargs, aargs, pert = case.ltx_args(tokens)
    row: dict[str, Any] = {"kind": "fused", "video_tokens": tokens, "graphs": args.graphs,
                           "bf16_ms": round(blk_bf16, 3)}  # fmt: skip
    for name, block in zip(("bf16_fused", "fp8_fused"), case.fused or (), strict=True):
        with torch.no_grad():
            run = lambda b=block: b(vargs, aargs, pert)  # noqa: E731
            out_v, out_a = block_outputs(run())
            replay, static = cuda_graph(run, device)
            if static is not None:
                replay()
                row[f"{name}_graph_vs_eager_max_abs_diff"] = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(block_outputs(static), (out_v, out_a), strict=True)
                )
            del replay, static
            ms = _measure(run, device, args)
            if args.kernels and device.type == "cuda":
                emit({"kind": "kernels", "video_tokens": tokens, "weights": name,
                                  **kernel_profile(run, args.kernels)})  # fmt: skip
        row.update({f"{name}_ms": round(ms, 3), f"{name}_speedup": round(blk_bf16 / ms, 3)})
        row.update({f"{name}_rel_err_video": rel_err(out_v, ref_v), f"{name}_rel_err_audio": rel_err(out_a, ref_a)})
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dims", choices=sorted(DIMS), default="19b")
    ap.add_argument("--tokens", default="1536,6144,24576")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", choices=("auto", "ltx", "standin"), default="auto",
                    help="ltx-core's block (auto: when ltx-core imports) or the synthetic stand-in")  # fmt: skip
    ap.add_argument("--fused", action="store_true", help="also the blocks with fused elementwise kernels")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="time eager calls only")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile a block call of each kind: device time by kernel family, top N")  # fmt: skip
    ap.add_argument(
        "--sdpa",
        choices=("default", "flash", "cudnn", "efficient"),
        default="default",
        help="the attention backend every SDPA call of the run uses (bench/attention.py compares them)",
    )
    args = ap.parse_args(argv)
    if args.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.sdpa]  # fmt: skip
        with sdpa_kernel([backend, SDPBackend.MATH], set_priority=True):
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    args.graphs = args.graphs and device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kind = args.block if args.block != "auto" else ("ltx" if ltx_core_available() else "standin")
    case = BlockCase(kind, DIMS[args.dims], device)
    if args.fused and kind != "ltx":
        emit({"kind": "note", "fused": "skipped: needs ltx-core's block (install ltx-core)"})
    elif args.fused:
        case.fuse()
    env = {"kind": "env", "torch": torch.__version__, "dims": args.dims, "block": kind, "sdpa": args.sdpa,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "fp8_tensor_cores": device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9),
           "fp8_linears": sum(isinstance(m, Fp8Linear) for m in case.fp8.modules())}  # fmt: skip
    emit(env)
    summary, ok = [], True
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = activation(1, tokens, case.width, gen, device)[0]
        q_t, s_t = quantize_rows(x)
        q_e, s_e = quantize_rows_eager(x)
        same = torch.equal(q_t.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s_t, s_e)
        g_t, g_e = quantize_rows(x, gelu=True)[0].float(), quantize_rows_eager(x, gelu=True)[0].float()
        emit({"kind": "check", "video_tokens": tokens, "quantize_bitwise_equal_to_eager": same,
                          "gelu_quantize_mismatch_fraction": round((g_t != g_e).float().mean().item(), 6)})  # fmt: skip
        ok &= same
        w = torch.randn(case.width, case.width, generator=gen, device=device, dtype=torch.bfloat16)
        qw, sw = quantize_weight(w)
        gemm = fp8_gemm(q_t, s_t, qw, sw, None, torch.bfloat16)
        emulated = emulated_gemm(q_t, s_t, qw, sw, None, torch.bfloat16)
        path = "torch._scaled_mm" if env["fp8_tensor_cores"] else "emulation"
        emit({"kind": "check", "video_tokens": tokens, "gemm_path": path,
                          "gemm_rel_diff_to_emulation": rel_err(gemm, emulated)})  # fmt: skip
        for row in _gemms(tokens, case.width, device, args):
            emit(row)
        attn_out = torch.randn_like(x)
        a2v_out = torch.randn(tokens, case.audio_width, generator=gen, device=device, dtype=torch.bfloat16)
        ctx = torch.randn(128, case.width, generator=gen, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin_bf16 = _measure(lambda: _linears(case.bf16, x, attn_out, a2v_out, ctx), device, args)  # noqa: B023
            lin_fp8 = _measure(lambda: _linears(case.fp8, x, attn_out, a2v_out, ctx), device, args)  # noqa: B023
            eager_bf16 = time_ms(lambda: _linears(case.bf16, x, attn_out, a2v_out, ctx), device, args.iters, 1)  # noqa: B023
            eager_fp8 = time_ms(lambda: _linears(case.fp8, x, attn_out, a2v_out, ctx), device, args.iters, 1)  # noqa: B023
        row = {"kind": "linears", "video_tokens": tokens, "graphs": args.graphs, "bf16_ms": round(lin_bf16, 3),
               "fp8_ms": round(lin_fp8, 3), "speedup": round(lin_bf16 / lin_fp8, 3),
               "eager_bf16_ms": round(eager_bf16, 3), "eager_fp8_ms": round(eager_fp8, 3),
               "eager_speedup": round(eager_bf16 / eager_fp8, 3)}  # fmt: skip
        emit(row)
        part = f"{tokens}: linears {row['speedup']}x"
        run_bf16, run_fp8, x_in = case.calls(tokens)
        with torch.no_grad():
            (ref_v, ref_a), (out_v, out_a) = block_outputs(run_bf16()), block_outputs(run_fp8())
            replay, static = cuda_graph(run_fp8, device)
            graph_diff = None
            if static is not None:  # the fp8 block replayed from a graph computes what it computes eagerly
                replay()
                graph_diff = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(block_outputs(static), (out_v, out_a), strict=True)
                )
            del replay, static
            blk_bf16 = _measure(run_bf16, device, args)
            blk_fp8 = _measure(run_fp8, device, args)
            eager_bf16 = time_ms(run_bf16, device, args.iters, 1)
            eager_fp8 = time_ms(run_fp8, device, args.iters, 1)
            for name, fn in (("bf16", run_bf16), ("fp8", run_fp8)):
                if args.kernels and device.type == "cuda":
                    emit({"kind": "kernels", "video_tokens": tokens, "weights": name,
                                      **kernel_profile(fn, args.kernels)})  # fmt: skip
        brow = {"kind": "block", "block": kind, "video_tokens": tokens, "graphs": args.graphs,
                "bf16_ms": round(blk_bf16, 3), "fp8_ms": round(blk_fp8, 3), "speedup": round(blk_bf16 / blk_fp8, 3),
                "eager_bf16_ms": round(eager_bf16, 3), "eager_fp8_ms": round(eager_fp8, 3),
                "eager_speedup": round(eager_bf16 / eager_fp8, 3),
                "rel_err_video": rel_err(out_v, ref_v), "rel_err_audio": rel_err(out_a, ref_a),
                "rel_err_video_update": rel_err(out_v - x_in, ref_v - x_in),
                "graph_vs_eager_max_abs_diff": graph_diff}  # fmt: skip
        emit(brow)
        part += f", block {brow['speedup']}x (err {100 * brow['rel_err_video']:.2f}%, graph-eager {graph_diff})"
        if case.fused is not None:
            frow = _fused_row(case, tokens, blk_bf16, ref_v, ref_a, device, args)
            emit(frow)
            part += (
                f", bf16 fused {frow['bf16_fused_speedup']}x (err {100 * frow['bf16_fused_rel_err_video']:.2f}%)"
                f", fp8 fused {frow['fp8_fused_speedup']}x (err {100 * frow['fp8_fused_rel_err_video']:.2f}%)"
            )
        summary.append(part)
        del run_bf16, run_fp8, x_in
    print(f"SUMMARY fp8/bf16 speedups ({kind} block) | {' | '.join(summary)} | triton==eager {ok} | {env['device']}",
          flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
