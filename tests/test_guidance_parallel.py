"""Guidance parallelism over real process groups (gloo, CPU): every layout G x S of worlds 2, 3 and 4
against single-process guided denoising.

Every rank builds the tiny LTX-2 AV transformer twice from one safetensors checkpoint: plain (the
reference: the runners' own `guided_denoise` with ltx-core's `MultiModalGuider`, all passes in one
process) and SP-patched with an `AttentionRouter` over the groups of every layout. For each layout and
each pass count (1 to 4: cond; + negative; + STG; + modality isolation, the reference's default), several
Euler steps from the same noise must end within 1e-5 (fp32) of the reference, on every rank, bit-identical
across ranks. Uneven shares (P=3 over G=2, P=4 over G=3) and idle groups (P=2 over G=3) are included;
token counts that need padding too. A planted defect (pass outputs gathered in the wrong order) must fail
the same comparison by a wide margin, so the tolerance is a real check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from ltx_mgpu.parallel.testing import LocalWorld, WorldContext, WorldPool
from ltx_mgpu.runners.smoke.checkpoint import ensure_smoke_checkpoint, tiny_transformer_config

# As in test_sp_parallel.py: fp32, only the summation order differs (SP splits rows, guidance groups batch
# fewer passes per matmul, so MKL may block the sums differently): ~1e-6 per forward at the tiny model's
# sizes, and the 3 Euler steps (|d sigma| <= 1) add up at most 3 of those. The planted defect moves > 1e-2.
TOL = 1e-5
HEADS = 12  # divisible by 1, 2, 3 and 4: every S of worlds 2, 3, 4
STEPS = 3
TOKENS = [(7, 1, 1), (3, 2, 2)]  # 7 tokens (padded at S = 2, 3, 4), 12 tokens (divisible)
# pass count -> (cfg, stg, modality scale): the passes guided_denoise builds
GUIDANCE = {1: (1.0, 0.0, 1.0), 2: (3.0, 0.0, 1.0), 3: (3.0, 1.0, 1.0), 4: (3.0, 1.0, 3.0)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS)
    return str(ensure_smoke_checkpoint(tmp_path_factory.mktemp("gp_ckpt"), transformer_config=cfg).transformer_path)


_POOL = WorldPool(timeout=300)


@pytest.fixture(scope="module")
def worlds() -> Any:
    yield _POOL
    _POOL.close()


def _world(size: int) -> LocalWorld:
    return _POOL.get(size)


# =========================================================================================================
# Functions run on every rank (shipped by value)
# =========================================================================================================


def _setup(ctx: WorldContext, path: str, max_tokens: int = 4096) -> dict[str, Any]:
    key = f"gp:{path}:{max_tokens}"
    if key not in ctx.cache:
        from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
        from ltx_core.model.transformer import X0Model
        from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

        from ltx_mgpu.parallel import AttentionRouter, LayoutGroups, SequenceParallelBuilder

        inner = SingleGPUModelBuilder(LTXModelConfigurator, path)
        cfg = inner.model_config()["transformer"]
        groups = LayoutGroups.build(ctx.world_size, ctx.rank, world_group=None)
        router = AttentionRouter.build(
            groups,
            max_tokens,
            cfg["num_attention_heads"],
            cfg["attention_head_dim"],
            torch.float32,
            backend="dist",
            device=ctx.device,
            head_counts=(cfg["audio_num_attention_heads"],),
        )
        sp = SequenceParallelBuilder(inner, router).build(dtype=torch.float32)
        reference = inner.build(device=ctx.device, dtype=torch.float32).eval()
        ctx.cache[key] = {
            "cfg": cfg,
            "groups": groups,
            "router": router,
            "x0_sp": X0Model(sp),
            "x0_ref": X0Model(reference),
        }
    return ctx.cache[key]


def _states(cfg: dict[str, Any], f: int, h: int, w: int, seed: int = 0) -> tuple[Any, Any, tuple, tuple]:
    from ltx_mgpu.runners.smoke.denoise import SmokeGeometry

    g = torch.Generator().manual_seed(seed)
    geo = SmokeGeometry(w * 32, h * 32, (f - 1) * 8 + 1, 24.0, cfg["in_channels"], cfg["audio_in_channels"])
    vs = geo.video_tools(1).create_initial_state("cpu", torch.float32)
    aus = geo.audio_tools(1).create_initial_state("cpu", torch.float32)
    vs = dataclasses.replace(vs, latent=torch.randn(vs.latent.shape, generator=g))
    aus = dataclasses.replace(aus, latent=torch.randn(aus.latent.shape, generator=g))
    caption = cfg["caption_channels"]
    pos = (torch.randn(1, 5, caption, generator=g), torch.randn(1, 5, caption, generator=g))
    neg = (torch.randn(1, 5, caption, generator=g), torch.randn(1, 5, caption, generator=g))
    return vs, aus, pos, neg


def _denoise(step: Any, vs: Any, aus: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The runners' Euler loop (blend conditioned tokens, Euler step) for STEPS steps."""
    from ltx_core.components.diffusion_steps import EulerDiffusionStep

    from ltx_mgpu.runners.ltx2.denoise import blend_clean

    sigmas = torch.tensor([*torch.linspace(1.0, 0.0, STEPS + 1)[:-1].tolist(), 0.0], dtype=torch.float32)
    euler = EulerDiffusionStep()
    for i in range(STEPS):
        dv, da = step(vs, aus, sigmas[i])
        dv, da = blend_clean(dv, vs), blend_clean(da, aus)
        vs = dataclasses.replace(vs, latent=euler.step(vs.latent, dv, sigmas, i))
        aus = dataclasses.replace(aus, latent=euler.step(aus.latent, da, sigmas, i))
    return vs.latent, aus.latent


def _step(x0: Any, passes: int, pos: tuple, neg: tuple, max_batch: int, run: Any = None) -> Any:
    from ltx_mgpu.runners.ltx2.denoise import GuidanceParams, guided_denoise, run_passes

    cfg, stg, modality = GUIDANCE[passes]
    video = GuidanceParams(cfg, stg, (1,), 0.7 if passes == 4 else 0.0, modality)
    audio = GuidanceParams(cfg, stg, (0,), 0.0, modality)
    step = guided_denoise(x0, max_batch, positive=pos, negative=neg, video=video, audio=audio, run=run or run_passes)
    assert step.passes == passes, (step.passes, passes)
    return step


def _layouts_vs_reference(
    ctx: WorldContext, path: str, tokens: list[tuple[int, int, int]], defect: bool = False
) -> list[dict[str, Any]]:
    from ltx_mgpu.parallel import GuidanceParallelPasses
    from ltx_mgpu.parallel.layouts import guidance as gmod
    from ltx_mgpu.parallel.layouts import layout
    from ltx_mgpu.runners.ltx2.denoise import run_passes

    env = _setup(ctx, path)
    original_gather = gmod.gather_pass_outputs
    if defect:  # planted defect: the gathered outputs come back in reverse pass order
        gmod.gather_pass_outputs = lambda *a, **k: list(reversed(original_gather(*a, **k)))
    results = []
    try:
        for f, h, w in tokens:
            for passes in sorted(GUIDANCE):
                vs, aus, pos, neg = _states(env["cfg"], f, h, w, seed=passes)
                with torch.no_grad():
                    ref_v, ref_a = _denoise(_step(env["x0_ref"], passes, pos, neg, max_batch=passes), vs, aus)
                for lay in layout.layouts_for(ctx.world_size):
                    run = GuidanceParallelPasses(
                        env["groups"], env["router"], run_passes, choose=lay, max_tokens=4096, device=ctx.device
                    )
                    with torch.no_grad():
                        v, a = _denoise(_step(env["x0_sp"], passes, pos, neg, max_batch=4, run=run), vs, aus)
                    results.append(
                        {
                            "tokens": f * h * w,
                            "passes": passes,
                            "layout": str(lay),
                            "video_diff": (v - ref_v).abs().max().item(),
                            "audio_diff": (a - ref_a).abs().max().item(),
                            "scale": ref_v.abs().max().item(),
                            "video_bytes": v.numpy().tobytes(),
                            "audio_bytes": a.numpy().tobytes(),
                            "active_after": str(env["router"].active_layout),
                        }
                    )
    finally:
        gmod.gather_pass_outputs = original_gather
    return results


def _budget(ctx: WorldContext, path: str) -> list[str]:
    """A step over budget raises the same ValueError on every rank before any collective, under every
    layout; the fleet is usable afterwards."""
    from ltx_mgpu.parallel import GuidanceParallelPasses
    from ltx_mgpu.parallel.layouts import layout
    from ltx_mgpu.runners.ltx2.denoise import run_passes

    env = _setup(ctx, path)
    messages = []
    vs, aus, pos, neg = _states(env["cfg"], 5, 2, 1)  # 10 tokens
    for lay in layout.layouts_for(ctx.world_size):
        run = GuidanceParallelPasses(
            env["groups"], env["router"], run_passes, choose=lay, max_tokens=8, device=ctx.device
        )
        try:
            with torch.no_grad():
                _step(env["x0_sp"], 3, pos, neg, max_batch=4, run=run)(vs, aus, torch.tensor(0.5))
        except ValueError as err:
            messages.append(f"{lay}: {err}")
    vs, aus, pos, neg = _states(env["cfg"], 3, 2, 2)
    run = GuidanceParallelPasses(
        env["groups"],
        env["router"],
        run_passes,
        choose=layout.layouts_for(ctx.world_size)[-1],
        max_tokens=4096,
        device=ctx.device,
    )
    with torch.no_grad():
        out = _step(env["x0_sp"], 3, pos, neg, max_batch=4, run=run)(vs, aus, torch.tensor(0.5))
    messages.append(f"after: {tuple(out[0].shape)}")
    return messages


# =========================================================================================================
# Tests
# =========================================================================================================


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_layout_matches_single_process(checkpoint: str, worlds: WorldPool, world_size: int) -> None:
    per_rank = _world(world_size).run(_layouts_vs_reference, checkpoint, TOKENS)
    layouts = {r["layout"] for r in per_rank[0]}
    assert len(layouts) == {2: 2, 3: 2, 4: 3}[world_size]
    for rank_results in per_rank:
        for res in rank_results:
            label = f"W={world_size} layout {res['layout']} P={res['passes']} T={res['tokens']}"
            assert res["video_diff"] <= TOL, f"{label}: video {res['video_diff']:.3g}"
            assert res["audio_diff"] <= TOL, f"{label}: audio {res['audio_diff']:.3g}"
            assert res["scale"] > 0.1, label
            assert res["active_after"] == f"1x{world_size}", label  # the router is restored after a step
    for i in range(len(per_rank[0])):  # every rank ends with the same bytes
        assert len({r[i]["video_bytes"] for r in per_rank}) == 1, per_rank[0][i]["layout"]
        assert len({r[i]["audio_bytes"] for r in per_rank}) == 1, per_rank[0][i]["layout"]


@pytest.mark.numerics
def test_planted_defect_fails_the_comparison(checkpoint: str, worlds: WorldPool) -> None:
    """Negative control: outputs gathered in the wrong pass order are far outside the tolerance for every
    guidance-parallel layout with several passes (the SP-only layout never gathers and stays exact)."""
    results = _world(2).run(_layouts_vs_reference, checkpoint, TOKENS[:1], defect=True)[0]
    for res in results:
        if res["layout"] == "2x1" and res["passes"] > 1:
            assert res["video_diff"] > 1e-2, res
        elif res["layout"] == "1x2":
            assert res["video_diff"] <= TOL, res


@pytest.mark.parametrize("world_size", [3, 4])
def test_budget_error_is_identical_on_every_rank(checkpoint: str, worlds: WorldPool, world_size: int) -> None:
    per_rank = _world(world_size).run(_budget, checkpoint)
    assert all(messages == per_rank[0] for messages in per_rank)
    errors = per_rank[0][:-1]
    assert len(errors) == {3: 2, 4: 3}[world_size], errors
    for message in errors:
        assert "exceeds attention_manager max_tokens (8). Use a smaller resolution or fewer frames." in message
    assert per_rank[0][-1] == "after: (1, 12, 16)"


def _gather_twice(ctx: WorldContext) -> dict[str, Any]:
    """P=3 over G=2 (rank 1 sends a spare row), two steps through one reused send buffer."""
    import torch.distributed as dist

    from ltx_mgpu.parallel.layouts.guidance import gather_pass_outputs, split_passes

    shares = split_passes(3, 2)
    specs = [((1, 4, 3), torch.float32), ((1, 2, 3), torch.float32)]
    buffers: dict = {}
    steps, pointers = [], []
    for step in range(2):
        mine = [
            (torch.full((1, 4, 3), 100.0 * step + p), torch.full((1, 2, 3), -100.0 * step - p))
            for p in shares[ctx.rank]
        ]
        out = gather_pass_outputs(mine, shares, ctx.rank, specs, dist.group.WORLD, ctx.device, buffers)
        steps.append([(float(v.mean()), float(a.mean())) for v, a in out])
        pointers.append([b.data_ptr() for b in buffers.values()])
    return {"steps": steps, "pointers": pointers}


def test_guidance_gather_reuses_its_send_buffer(worlds: WorldPool) -> None:
    for res in _world(2).run(_gather_twice):
        for step, got in enumerate(res["steps"]):
            assert got == [(100.0 * step + p, -100.0 * step - p) for p in range(3)]
        assert len(res["pointers"][0]) == 1 and res["pointers"][0] == res["pointers"][1]
