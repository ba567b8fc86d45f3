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
  installed (the GPU hosts' bare image) a synthetic stand-in (`fp8_standin.py`: the same linears and call
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

    python bench/fp8.py                                  # one H200, ~40 s
    python bench/fp8.py --tokens 6144,24576 --kernels 12  # plus device time by kernel family and the top 12
    python bench/fp8.py --fused --kernels 12             # plus the fused blocks (needs ltx-core)
    python bench/fp8.py --device cpu --dims tiny --tokens 96,192 --iters 1 --warmup 0   # smoke check (CI)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_standin import StandInBlock
from sp_block import DIMS, _build, _config, _inputs, _time

from ltx_mgpu.fp8 import Fp8Linear, convert_linears, quantize_rows, quantize_rows_eager, quantize_weight
from ltx_mgpu.fp8.linear import emulated_gemm, fp8_gemm


def _graph(fn: Any, device: torch.device) -> tuple[Any, Any]:
    """(replay, the captured call's output): `fn` captured in a CUDA graph (as the runners run every
    denoising forward) after two warm-up calls on a side stream (Triton compiles, the bias probe runs);
    (fn, None) where capture fails or on CPU."""
    if device.type != "cuda":
        return fn, None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except RuntimeError as exc:
        print(json.dumps({"kind": "note", "graph_capture_failed": str(exc)[:500]}), flush=True)
        return fn, None
    return graph.replay, out


def _measure(fn: Any, device: torch.device, args: Any) -> float:
    """ms per call: graph replays unless --no-graphs (eager launches cost ~10-30 us a linear on the host)."""
    run = _graph(fn, device)[0] if args.graphs else fn
    return _time(run, device, args.iters, args.warmup)


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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)


def _ltx_core() -> bool:
    try:
        import ltx_core  # noqa: F401
    except ImportError:
        return False
    return True


class _Case:
    """The block under test, bf16 and fp8 (same weights), and how to call it at a token count."""

    def __init__(self, kind: str, dims: dict[str, int], device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.width, self.audio_width = dims["heads"] * dims["head_dim"], dims["audio_heads"] * dims["audio_head_dim"]
        if kind == "ltx":
            self.cfg = _config(dims)
            self.model = _build(self.cfg, device, torch.bfloat16)
            self.bf16 = self.model.transformer_blocks[0]
        else:
            torch.manual_seed(0)
            with torch.device(device):  # initialised where it runs: ~0.3 B parameters at 19B dims
                block = StandInBlock(self.width, dims["heads"], self.audio_width, dims["audio_heads"])
            self.bf16 = block.to(dtype=torch.bfloat16).eval()
        self.fp8 = convert_linears(copy.deepcopy(self.bf16), quantize=True)
        self.fused: tuple[Any, Any] | None = None

    def fuse(self) -> None:
        """Fused-elementwise copies of the bf16 and fp8 blocks (`ltx_mgpu.fused`; ltx-core's block only)."""
        from ltx_mgpu.fused.block import fuse_elementwise

        self.fused = tuple(copy.deepcopy(b) for b in (self.bf16, self.fp8))
        for b in self.fused:
            fuse_elementwise(b)

    def ltx_args(self, tokens: int) -> tuple[Any, Any, Any]:
        """(video args, audio args, perturbations): what an ltx-core block is called with at `tokens`."""
        from ltx_core.guidance.perturbations import BatchedPerturbationConfig

        vargs, aargs, _, _ = _inputs(self.model, self.cfg, tokens, self.device, torch.bfloat16)
        return vargs, aargs, BatchedPerturbationConfig.empty(1)

    def calls(self, tokens: int) -> tuple[Any, Any, Any]:
        """(bf16 call, fp8 call, the input's video tokens x) for `tokens` video tokens."""
        if self.kind == "ltx":
            vargs, aargs, pert = self.ltx_args(tokens)
            return (lambda: self.bf16(vargs, aargs, pert)), (lambda: self.fp8(vargs, aargs, pert)), vargs.x
        gen = torch.Generator(device=self.device).manual_seed(tokens + 1)
        x = _activation(1, tokens, self.width, gen, self.device)
        ctx = torch.randn(1, 128, self.width, generator=gen, device=self.device, dtype=torch.bfloat16)
        audio = torch.randn(1, 126, self.audio_width, generator=gen, device=self.device, dtype=torch.bfloat16)
        return (lambda: self.bf16(x, ctx, audio)), (lambda: self.fp8(x, ctx, audio)), x


def _activation(b: int, tokens: int, width: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    x = torch.randn(b, tokens, width, generator=gen, device=device, dtype=torch.bfloat16)
    x[..., :: max(1, width // 32)] *= 20.0  # a few outlier channels, as trained transformers have
    return x


def _outputs(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    video, audio = out
    return getattr(video, "x", video), getattr(audio, "x", audio)


def _fused_row(case: _Case, tokens: int, blk_bf16: float, ref_v: torch.Tensor, ref_a: torch.Tensor,
               device: torch.device, args: Any) -> dict[str, Any]:  # fmt: skip
    """The fused bf16 and fp8 blocks at `tokens`: time (graph replays), ratio to the bf16 block, error against
    the bf16 eager block, and the graph replay against the eager call."""
    vargs, aargs, pert = case.ltx_args(tokens)
    row: dict[str, Any] = {"kind": "fused", "video_tokens": tokens, "graphs": args.graphs,
                           "bf16_ms": round(blk_bf16, 3)}  # fmt: skip
    for name, block in zip(("bf16_fused", "fp8_fused"), case.fused or (), strict=True):
        with torch.no_grad():
            run = lambda b=block: b(vargs, aargs, pert)  # noqa: E731
            out_v, out_a = _outputs(run())
            replay, static = _graph(run, device)
            if static is not None:
                replay()
                row[f"{name}_graph_vs_eager_max_abs_diff"] = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(_outputs(static), (out_v, out_a), strict=True)
                )
            del replay, static
            ms = _measure(run, device, args)
            if args.kernels and device.type == "cuda":
                print(json.dumps({"kind": "kernels", "video_tokens": tokens, "weights": name,
                                  **kernel_profile(run, args.kernels)}), flush=True)  # fmt: skip
        row.update({f"{name}_ms": round(ms, 3), f"{name}_speedup": round(blk_bf16 / ms, 3)})
        row.update({f"{name}_rel_err_video": _rel(out_v, ref_v), f"{name}_rel_err_audio": _rel(out_a, ref_a)})
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
    kind = args.block if args.block != "auto" else ("ltx" if _ltx_core() else "standin")
    case = _Case(kind, DIMS[args.dims], device)
    if args.fused and kind != "ltx":
        print(json.dumps({"kind": "note", "fused": "skipped: needs ltx-core's block (install ltx-core)"}), flush=True)
    elif args.fused:
        case.fuse()
    env = {"kind": "env", "torch": torch.__version__, "dims": args.dims, "block": kind, "sdpa": args.sdpa,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "fp8_tensor_cores": device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9),
           "fp8_linears": sum(isinstance(m, Fp8Linear) for m in case.fp8.modules())}  # fmt: skip
    print(json.dumps(env), flush=True)
    summary, ok = [], True
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = _activation(1, tokens, case.width, gen, device)[0]
        q_t, s_t = quantize_rows(x)
        q_e, s_e = quantize_rows_eager(x)
        same = torch.equal(q_t.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s_t, s_e)
        g_t, g_e = quantize_rows(x, gelu=True)[0].float(), quantize_rows_eager(x, gelu=True)[0].float()
        print(json.dumps({"kind": "check", "video_tokens": tokens, "quantize_bitwise_equal_to_eager": same,
                          "gelu_quantize_mismatch_fraction": round((g_t != g_e).float().mean().item(), 6)}),
              flush=True)  # fmt: skip
        ok &= same
        w = torch.randn(case.width, case.width, generator=gen, device=device, dtype=torch.bfloat16)
        qw, sw = quantize_weight(w)
        gemm = fp8_gemm(q_t, s_t, qw, sw, None, torch.bfloat16)
        emulated = emulated_gemm(q_t, s_t, qw, sw, None, torch.bfloat16)
        path = "torch._scaled_mm" if env["fp8_tensor_cores"] else "emulation"
        print(json.dumps({"kind": "check", "video_tokens": tokens, "gemm_path": path,
                          "gemm_rel_diff_to_emulation": _rel(gemm, emulated)}), flush=True)  # fmt: skip
        for row in _gemms(tokens, case.width, device, args):
            print(json.dumps(row), flush=True)
        attn_out = torch.randn_like(x)
        a2v_out = torch.randn(tokens, case.audio_width, generator=gen, device=device, dtype=torch.bfloat16)
        ctx = torch.randn(128, case.width, generator=gen, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin_bf16 = _measure(lambda: _linears(case.bf16, x, attn_out, a2v_out, ctx), device, args)  # noqa: B023
            lin_fp8 = _measure(lambda: _linears(case.fp8, x, attn_out, a2v_out, ctx), device, args)  # noqa: B023
            eager_bf16 = _time(lambda: _linears(case.bf16, x, attn_out, a2v_out, ctx), device, args.iters, 1)  # noqa: B023
            eager_fp8 = _time(lambda: _linears(case.fp8, x, attn_out, a2v_out, ctx), device, args.iters, 1)  # noqa: B023
        row = {"kind": "linears", "video_tokens": tokens, "graphs": args.graphs, "bf16_ms": round(lin_bf16, 3),
               "fp8_ms": round(lin_fp8, 3), "speedup": round(lin_bf16 / lin_fp8, 3),
               "eager_bf16_ms": round(eager_bf16, 3), "eager_fp8_ms": round(eager_fp8, 3),
               "eager_speedup": round(eager_bf16 / eager_fp8, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)
        part = f"{tokens}: linears {row['speedup']}x"
        run_bf16, run_fp8, x_in = case.calls(tokens)
        with torch.no_grad():
            (ref_v, ref_a), (out_v, out_a) = _outputs(run_bf16()), _outputs(run_fp8())
            replay, static = _graph(run_fp8, device)
            graph_diff = None
            if static is not None:  # the fp8 block replayed from a graph computes what it computes eagerly
                replay()
                graph_diff = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(_outputs(static), (out_v, out_a), strict=True)
                )
            del replay, static
            blk_bf16 = _measure(run_bf16, device, args)
            blk_fp8 = _measure(run_fp8, device, args)
            eager_bf16 = _time(run_bf16, device, args.iters, 1)
            eager_fp8 = _time(run_fp8, device, args.iters, 1)
            for name, fn in (("bf16", run_bf16), ("fp8", run_fp8)):
                if args.kernels and device.type == "cuda":
                    print(json.dumps({"kind": "kernels", "video_tokens": tokens, "weights": name,
                                      **kernel_profile(fn, args.kernels)}), flush=True)  # fmt: skip
        brow = {"kind": "block", "block": kind, "video_tokens": tokens, "graphs": args.graphs,
                "bf16_ms": round(blk_bf16, 3), "fp8_ms": round(blk_fp8, 3), "speedup": round(blk_bf16 / blk_fp8, 3),
                "eager_bf16_ms": round(eager_bf16, 3), "eager_fp8_ms": round(eager_fp8, 3),
                "eager_speedup": round(eager_bf16 / eager_fp8, 3),
                "rel_err_video": _rel(out_v, ref_v), "rel_err_audio": _rel(out_a, ref_a),
                "rel_err_video_update": _rel(out_v - x_in, ref_v - x_in),
                "graph_vs_eager_max_abs_diff": graph_diff}  # fmt: skip
        print(json.dumps(brow), flush=True)
        part += f", block {brow['speedup']}x (err {100 * brow['rel_err_video']:.2f}%, graph-eager {graph_diff})"
        if case.fused is not None:
            frow = _fused_row(case, tokens, blk_bf16, ref_v, ref_a, device, args)
            print(json.dumps(frow), flush=True)
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
