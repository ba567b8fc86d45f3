"""Guided denoising steps on real multi-process fleets: sequence parallelism, guidance parallelism and
both, eager and CUDA-graphed, against one GPU in the same run. A measurement, not a projection.

Workload: ltx-core's LTX-2 AV transformer at the 19B block dimensions (read from `LTXModel`'s defaults:
video 32 heads x 128, audio 32 x 64, text cross-attention 4096 / 2048 wide, FFN x4; Gemma's 3840-wide
caption input), N layers (default 8), random bf16 weights identical on every rank, video tokens
1,536 / 6,144 / 24,576 (LTX-2's 768x512x121 request at half and full resolution, and 4x that), 126 audio
tokens (121 frames at 24 fps), 128 text tokens. One *step* = the P passes of ltx-core's multi-modal
guider (P=1: conditional only; 2: + negative prompt; 3: + STG; 4: + modality isolation, the reference's
default) under a layout G x S (`ltx_mgpu.parallel`), including the guidance all-gather and the combine,
exactly as the two-stage runner's stage 1 runs it.

Per fleet size W (1 first; 2, 4, 8 when the host has the GPUs), every valid layout (SP only 1xW,
guidance only Wx1, both) and mode:
- `eager`: the hoisted forward; `graphed`: through `CudaGraphForward` (the row says which path really
  ran: graph replay, or eager and why); `plain`: ltx-core's own per-forward preparation (--modes).
Rows (JSON lines, "kind": "row"): ms per step (max over ranks, after warm-up, wall clock over --iters
steps between two device syncs), ms per layer per step, speedup and efficiency against W=1 in the same
mode, the largest absolute difference of the combined output from W=1 (and in bf16 ulps of the output
scale), the cost model's estimate and choice. Then "kind": "calibration" (CostModel constants fitted to
these rows) and one line `SUMMARY {...}` with the issue's target rows.

    python -m bench.sp_scaling --quick                    # 2 H200s, < 4 min: the issue's target rows
    python -m bench.sp_scaling                            # the full grid
    python -m bench.sp_scaling --device cpu --dims tiny   # CI: CPU ranks over gloo, a few seconds
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench.common import emit, emit_summary
from ltx_mgpu import MGPUController, MGPURunner
from ltx_mgpu.parallel.layouts.cost_model import CostModel, LayerDims, StepShape, choose_layout, valid_layouts
from ltx_mgpu.parallel.layouts.layout import ParallelLayout, layout_groups

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GUIDANCE = {1: (1.0, 0.0, 1.0), 2: (3.0, 0.0, 1.0), 3: (3.0, 1.0, 1.0), 4: (3.0, 1.0, 3.0)}  # cfg, stg, modality
GEOMETRY = {1536: (16, 8, 12), 6144: (16, 16, 24), 24576: (16, 32, 48)}  # latent frames, height, width
AUDIO_TOKENS, CONTEXT_TOKENS = 126, 128  #: what the cost-model columns assume (19B runs; tiny runs differ)
TINY_DEFAULTS = {"tokens": "37", "passes": "1,3", "layers": 2, "iters": 2, "warmup": 1}
QUICK = {"tokens_passes": [(1536, 2), (1536, 4), (6144, 1), (6144, 3)], "worlds": [1, 2], "iters": 8}


def model_dims(dims: str) -> dict[str, int]:
    """The block widths: "19b" from ltx-core's `LTXModel` defaults, "tiny" for CPU smoke runs."""
    if dims == "tiny":
        return {"heads": 4, "head_dim": 16, "audio_heads": 4, "audio_head_dim": 8, "channels": 16, "caption": 32}
    from ltx_core.model.transformer.model import LTXModel

    d = {k: p.default for k, p in inspect.signature(LTXModel.__init__).parameters.items()}
    return {
        "heads": d["num_attention_heads"],
        "head_dim": d["attention_head_dim"],
        "audio_heads": d["audio_num_attention_heads"],
        "audio_head_dim": d["audio_attention_head_dim"],
        "channels": d["in_channels"],
        "caption": 3840,  # Gemma 3 hidden size (the 19B model's caption projection input)
    }


def _geometry(tokens: int) -> tuple[int, int, int]:
    if tokens in GEOMETRY:
        return GEOMETRY[tokens]
    for frames in (4, 3, 2, 1):
        if tokens % frames == 0:
            rest = tokens // frames
            h = max(d for d in range(1, math.isqrt(rest) + 1) if rest % d == 0)
            return frames, h, rest // h
    raise ValueError(tokens)


# =========================================================================================================
# The runner (every rank)
# =========================================================================================================


class ScalingRunner(MGPURunner):
    def setup(self, *, dims: str, layers: int, dtype: str, max_tokens: int, backend: str, seed: int = 0) -> None:
        from ltx_core.model.transformer import X0Model
        from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

        from ltx_mgpu.parallel import AttentionRouter, SequenceParallelModelWrapper
        from ltx_mgpu.parallel.sp.builder import patch_sp_attention
        from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

        d = model_dims(dims)
        self.dims, self.dtype = d, getattr(torch, dtype)
        cfg = tiny_transformer_config(
            num_layers=layers,
            num_heads=d["heads"],
            head_dim=d["head_dim"],
            audio_num_heads=d["audio_heads"],
            audio_head_dim=d["audio_head_dim"],
            latent_channels=d["channels"],
            audio_channels=d["channels"],
            caption_channels=d["caption"],
        )
        self.cfg = cfg["transformer"]
        with torch.device("meta"):
            model = LTXModelConfigurator.from_config(cfg)
        model = model.to_empty(device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)  # same bits on every rank
        with torch.no_grad():
            for p in model.parameters():
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                p.normal_(0.0, 0.5 / math.sqrt(fan_in), generator=gen)
        model = model.to(self.dtype).eval()
        self.layout_groups = layout_groups(self)
        self.router = AttentionRouter.build(
            self.layout_groups,
            max_tokens,
            d["heads"],
            d["head_dim"],
            self.dtype,
            backend=backend,
            device=self.device,
            head_counts=(d["audio_heads"],),
        )
        patch_sp_attention(model, self.router)
        self.max_tokens = max_tokens
        self.x0 = {
            "eager": X0Model(SequenceParallelModelWrapper(model, self.router)),
            "plain": X0Model(SequenceParallelModelWrapper(model, self.router, hoist=False)),
        }

    def _inputs(self, tokens: int, seed: int) -> tuple[Any, Any, tuple, tuple]:
        import dataclasses

        from ltx_mgpu.runners.smoke.denoise import SmokeGeometry

        f, h, w = _geometry(tokens)
        ch = self.cfg["in_channels"]
        geo = SmokeGeometry(w * 32, h * 32, (f - 1) * 8 + 1, 24.0, ch, self.cfg["audio_in_channels"])
        g = torch.Generator().manual_seed(seed)  # CPU: identical on every rank and device

        def state(tools: Any) -> Any:
            s = tools.create_initial_state(self.device, self.dtype)
            return dataclasses.replace(s, latent=torch.randn(s.latent.shape, generator=g).to(self.device, self.dtype))

        vs, aus = state(geo.video_tools(1)), state(geo.audio_tools(1))
        caption = self.cfg["caption_channels"]

        def ctx() -> tuple[torch.Tensor, torch.Tensor]:
            pair = [torch.randn(1, CONTEXT_TOKENS, caption, generator=g).to(self.device, self.dtype) for _ in range(2)]
            return pair[0], pair[1]

        return vs, aus, ctx(), ctx()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(
        self, *, tokens: int, passes: int, layout: str, mode: str, iters: int, warmup: int
    ) -> Iterator[dict[str, Any]]:
        import torch.distributed as dist

        from ltx_mgpu.parallel import CudaGraphForward, GuidanceParallelPasses
        from ltx_mgpu.runners.ltx2.denoise import GuidanceParams, guided_denoise, run_passes

        vs, aus, pos, neg = self._inputs(tokens, seed=tokens + passes)
        cfg, stg, modality = GUIDANCE[passes]
        graphed = CudaGraphForward(  # one per job: its graphs (and their memory) go with it
            self.x0["eager"],
            key_fn=lambda: self.router.active_layout,
            capturable=self.router.capture_blocker,
            agree=self.router.all_agree,
        )
        x0 = graphed if mode == "graphed" else self.x0[mode]
        run = GuidanceParallelPasses(
            self.layout_groups, self.router, run_passes, choose=layout, max_tokens=self.max_tokens, device=self.device
        )
        step = guided_denoise(
            x0,
            passes,
            positive=pos,
            negative=neg,
            video=GuidanceParams(cfg, stg, (0,), 0.7 if passes == 4 else 0.0, modality),
            audio=GuidanceParams(cfg, stg, (0,), 0.7 if passes == 4 else 0.0, modality),
            run=run,
        )
        sigma = torch.tensor(0.7, device=self.device)
        with torch.inference_mode():
            for _ in range(warmup):
                out = step(vs, aus, sigma)
            self._sync()
            if self.world_size > 1:
                dist.barrier(group=self.groups.control_group)
            t0 = time.perf_counter()
            for _ in range(iters):
                out = step(vs, aus, sigma)
            self._sync()
            ms = (time.perf_counter() - t0) * 1e3 / iters
        times: list[Any] = [ms]
        if self.world_size > 1:
            times = [None] * self.world_size
            dist.all_gather_object(times, ms, group=self.groups.control_group)
        if self.is_driver:
            yield {
                "rank_ms": [round(t, 3) for t in times],
                "path": graphed.last_path if mode == "graphed" else f"eager ({mode})",
                "graphs": graphed.describe() if mode == "graphed" else None,
                "video": out[0].float().cpu(),
                "backend": self.router.manager(layout).backend_name,
            }


# =========================================================================================================
# The driver
# =========================================================================================================


def bf16_ulps(diff: float, scale: float) -> float:
    """`diff` in units of one bf16 ulp at `scale` (8 significant bits)."""
    if scale <= 0:
        return 0.0
    return diff / 2.0 ** (math.floor(math.log2(scale)) - 7)


def calibrate(rows: list[dict[str, Any]], base: CostModel) -> dict[str, Any]:
    """Fit the cost model's rate curve to single-GPU rows (graphed if any, else eager) and the exchange and
    gather costs to the multi-GPU ones: 1/rate = 1/R + m0/(R*M) is linear in 1/M."""
    one = [r for r in rows if r["world"] == 1]
    mode = "graphed" if any(r["mode"] == "graphed" for r in one) else "eager"
    pts = [
        (r["rows_per_rank"] * r["tokens_per_rank"], r["flop_per_layer"] / (r["ms_per_layer"] * 1e-3))
        for r in one
        if r["mode"] == mode
    ]
    out: dict[str, Any] = {"kind": "calibration", "from_mode": mode, "points": len(pts)}
    if len(pts) >= 2:
        xs, ys = [1.0 / m for m, _ in pts], [1.0 / rate for _, rate in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        intercept = my - slope * mx
        if intercept > 0 and slope >= 0:
            out["flops_per_s"] = float(f"{1.0 / intercept:.3g}")
            out["half_rate_tokens"] = round(slope / intercept, 1)
        else:
            out["fit"] = "no rate curve fits these points (timings too noisy or too few sizes)"
    sp = [r for r in rows if r["world"] > 1 and r["layout"].startswith("1x") and r["mode"] == mode]
    if sp:
        residual = [(r["ms_per_layer"] - r["model_compute_ms"]) / 7 for r in sp]
        out["exchange_ms"] = round(max(0.0, sorted(residual)[len(residual) // 2]), 4)
    eager = [r for r in one if r["mode"] == "eager"]
    if eager:
        out["host_ms_eager"] = round(min(r["ms_per_layer"] for r in eager), 3)
    names = ("flops_per_s", "half_rate_tokens", "exchange_ms", "host_ms_eager")
    out["current"] = {k: getattr(base, k) for k in names}
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dims", default="19b", choices=["19b", "tiny"])
    ap.add_argument("--layers", type=int, default=None, help="default 8 (tiny: 2)")
    ap.add_argument("--tokens", default=None, help="default 1536,6144,24576 (tiny: 37)")
    ap.add_argument("--passes", default=None, help="default 1,2,3,4 (tiny: 1,3)")
    ap.add_argument("--worlds", default=None, help="default: 1,2,4,8 up to the GPUs present (CPU: 1,2)")
    ap.add_argument("--modes", default="eager,graphed", help="any of eager, graphed, plain")
    ap.add_argument("--layouts", default="all", choices=["all", "sp", "gp", "both"])
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 10; tiny: 2; quick: 8)")
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (>= 2: graphs are captured before timing)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (CUDA), float32 (CPU)")
    ap.add_argument("--quick", action="store_true", help="the issue's target rows on W=1 and 2 (< 4 min)")
    args = ap.parse_args(argv)
    tiny = TINY_DEFAULTS if args.dims == "tiny" else {}
    args.layers = args.layers or tiny.get("layers", 8)
    args.tokens = args.tokens or tiny.get("tokens", "1536,6144,24576")
    args.passes = args.passes or tiny.get("passes", "1,2,3,4")
    args.iters = args.iters or tiny.get("iters", 10)
    args.warmup = args.warmup or tiny.get("warmup", 3)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.grid = [(int(t), int(p)) for t in args.tokens.split(",") for p in args.passes.split(",")]
    gpus = 2 if args.device == "cpu" else torch.cuda.device_count()
    args.world_list = (
        [int(w) for w in args.worlds.split(",")] if args.worlds else [w for w in (1, 2, 4, 8) if w <= gpus]
    )
    if args.quick:
        args.grid, args.world_list, args.iters = (
            QUICK["tokens_passes"],
            QUICK["worlds"],
            min(args.iters, QUICK["iters"]),
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)  # inherited by every rank process
    cpu = args.device == "cpu"
    if cpu:  # one thread per rank: intra-op thread pools of co-located ranks fight over the cores otherwise
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = model_dims(args.dims)
    video_width, audio_width = d["heads"] * d["head_dim"], d["audio_heads"] * d["audio_head_dim"]
    dims = LayerDims(d["heads"], d["head_dim"], d["audio_heads"], d["audio_head_dim"], video_width, audio_width)
    max_tokens = max(t * p for t, p in args.grid)
    model = CostModel()
    device_name = "cpu" if cpu else torch.cuda.get_device_name(0)
    emit(
        {
            "kind": "env",
            "torch": torch.__version__,
            "device": device_name,
            "dims": d,
            "layers": args.layers,
            "dtype": args.dtype,
            "worlds": args.world_list,
            "nccl_env": {k: os.environ[k] for k in NCCL_ENV},
        }
    )
    rows: list[dict[str, Any]] = []
    ctx = _Baselines()
    for world in args.world_list:
        devices = ["cpu"] * world if cpu else [f"cuda:{i}" for i in range(world)]
        ctl = MGPUController(ScalingRunner, devices=devices)
        t0 = time.perf_counter()
        setup = {"dims": args.dims, "layers": args.layers, "dtype": args.dtype, "max_tokens": max_tokens}
        ctl.start(timeout=900, backend=args.backend, **setup)
        emit({"kind": "fleet", "world": world, "start_s": round(time.perf_counter() - t0, 2)})
        try:
            for tokens, passes in args.grid:
                for layout in valid_layouts(world, passes, dims):
                    kind = "sp" if layout.guidance == 1 else ("gp" if layout.sequence == 1 else "both")
                    if world > 1 and args.layouts not in ("all", kind):
                        continue
                    for mode in args.modes.split(","):
                        job = {"tokens": tokens, "passes": passes, "layout": str(layout), "mode": mode}
                        events = ctl.stream(timeout=900, iters=args.iters, warmup=args.warmup, **job)
                        (res,) = [e for e in events if isinstance(e, dict)]
                        rows.append(_row(res, world, layout, mode, args.layers, dims, model, ctx, tokens, passes))
                        emit(rows[-1])
        finally:
            ctl.shutdown(graceful_timeout=30)
    emit(calibrate(rows, model))
    emit_summary(targets_summary(rows))
    return 0


class _Baselines:
    """W=1 results the other rows are compared with (same run)."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.ms: dict[tuple[int, int, str], float] = {}


def _row(
    res: dict[str, Any],
    world: int,
    layout: ParallelLayout,
    mode: str,
    layers: int,
    dims: LayerDims,
    model: CostModel,
    baselines: _Baselines,
    tokens: int,
    passes: int,
) -> dict[str, Any]:
    ms = max(res["rank_ms"])
    video = res.pop("video")
    key = (tokens, passes)
    if world == 1:
        baselines.outputs.setdefault(key, video)  # the first W=1 mode is the reference output
        baselines.ms[(tokens, passes, mode)] = ms
    ref = baselines.outputs.get(key)
    diff = (video - ref).abs().max().item() if ref is not None else None
    scale = ref.abs().max().item() if ref is not None else 0.0
    rows_per_rank = math.ceil(passes / layout.guidance)
    flop = rows_per_rank * dims.layer_flop(tokens, layout.sequence, AUDIO_TOKENS, CONTEXT_TOKENS)
    shape = StepShape(tokens, passes, dims, AUDIO_TOKENS, CONTEXT_TOKENS, graphed=mode == "graphed")
    estimate = model.layer_ms(layout, shape)
    chosen = choose_layout(world, shape, layers=layers)
    base = baselines.ms.get((tokens, passes, mode))
    speedup = base / ms if base else None
    return {
        "kind": "row",
        "world": world,
        "tokens": tokens,
        "passes": passes,
        "layout": str(layout),
        "mode": mode,
        "ms_step": round(ms, 3),
        "ms_per_layer": round(ms / layers, 3),
        "speedup": round(speedup, 3) if speedup else None,
        "efficiency": round(speedup / world, 3) if speedup else None,
        "max_abs_diff": diff,
        "ulps": round(bf16_ulps(diff, scale), 2) if diff is not None else None,
        "rows_per_rank": rows_per_rank,
        "tokens_per_rank": math.ceil(tokens / layout.sequence),
        "flop_per_layer": flop,
        "model_ms_per_layer": round(estimate, 3),
        "model_compute_ms": round(model.compute_ms(layout, shape), 3),
        "model_choice": str(chosen.layout),
        **res,
    }


def targets_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best layout per (W, tokens, passes, mode), and the issue's target rows (two GPUs)."""
    best: dict[tuple[int, int, int, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["world"], r["tokens"], r["passes"], r["mode"])
        if key not in best or r["ms_step"] < best[key]["ms_step"]:
            best[key] = r
    fields = ("layout", "ms_per_layer", "speedup", "model_choice", "path")
    table = {f"W{w} T{t} P{p} {m}": {f: r.get(f) for f in fields} for (w, t, p, m), r in sorted(best.items())}
    targets = {}
    for t, p, goal in (
        (1536, 2, "ms/layer <= 2.4"),
        (1536, 4, "ms/layer <= 4.5"),
        (6144, 1, ">= 1.8x"),
        (6144, 3, ">= 1.9x"),
    ):
        cands = [r for (w, tt, pp, _), r in best.items() if w == 2 and tt == t and pp == p]
        if cands:
            r = min(cands, key=lambda x: x["ms_step"])
            targets[f"T{t} P{p} ({goal})"] = {f: r[f] for f in ("mode", "layout", "ms_per_layer", "speedup", "path")}
    ulps = [r["ulps"] for r in rows if r["world"] > 1 and r["ulps"] is not None]
    return {"targets_W2": targets, "max_ulps_vs_W1": max(ulps) if ulps else None, "best": table}


if __name__ == "__main__":
    sys.exit(main())
