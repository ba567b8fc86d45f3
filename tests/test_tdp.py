"""Tiled data parallelism: tiling geometry, blend masks, and the wrapper on one process and on 2 CPU ranks.

Stated tolerances (float32, the tiny real LTX-2 transformer, 2x2 tiles with overlap 2 on an 8x12 grid):
- constant latent (every token identical): tiled == untiled within 1e-5 (attention over identical values
  returns that value, so a tile sees exactly what the whole video sees);
- smooth latent (constant plus a half-period sine bump of amplitude 0.05): max |tiled - untiled| < 0.05
  (measured 0.026 against outputs of magnitude ~2); TDP is not faithful, the error grows with the
  input's variation, which is why it is only used for refinement stages.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ltx_mgpu.parallel.pipeline.tdp import TiledDataParallelModelWrapper, shared_weights_model
from ltx_mgpu.parallel.pipeline.tiling import (
    BalancedTiling,
    DimensionTiling,
    TileCountConfig,
    blend_weights,
    build_tiles,
    split_axis,
    trapezoid,
)
from ltx_mgpu.parallel.testing import LocalWorld
from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

GRID = (2, 8, 12)
TILING_2x2 = TileCountConfig(height=DimensionTiling(2, 2), width=DimensionTiling(2, 2))


# ---- geometry ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "n", "overlap"), [(12, 1, 0), (12, 2, 2), (13, 3, 2), (8, 4, 1), (24, 5, 2), (7, 7, 0), (16, 2, 4)]
)
def test_split_axis_covers_with_exact_overlaps(length, n, overlap):
    tiles = split_axis(length, n, overlap)
    assert len(tiles) == n
    assert tiles[0].start == 0 and tiles[-1].end == length
    for a, b in itertools.pairwise(tiles):
        assert a.end - b.start == overlap
        assert a.right_ramp == b.left_ramp == overlap
    sizes = [t.size for t in tiles]
    assert max(sizes) - min(sizes) <= 1
    total = torch.zeros(length)
    for t in tiles:
        total[t.start : t.end] += trapezoid(t.size, t.left_ramp, t.right_ramp)
    torch.testing.assert_close(total, torch.ones(length))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "tiling",
    [
        TILING_2x2,
        TileCountConfig(DimensionTiling(2, 0), DimensionTiling(3, 1), DimensionTiling(2, 3)),
        TileCountConfig(width=DimensionTiling(5, 1)),
        BalancedTiling(4, overlap=2),
        BalancedTiling(6, overlap=1),
    ],
)
def test_blend_masks_sum_to_one(tiling):
    weights = blend_weights(GRID, tiling)
    assert weights.shape == GRID
    # a handful of fp32 weights in [0, 1] summed per cell: a few u = 6e-8 of rounding at most
    torch.testing.assert_close(weights, torch.ones(GRID), rtol=0, atol=1e-6)


def test_split_errors_are_clear():
    with pytest.raises(ValueError, match="cannot split 3 latent height into 4 tiles"):
        split_axis(3, 4, 0, axis="height")
    with pytest.raises(ValueError, match="need >= 6"):
        split_axis(10, 3, 3)
    with pytest.raises(ValueError, match="num_tiles must be >= 1"):
        DimensionTiling(0)
    with pytest.raises(ValueError, match="overlap must be >= 0"):
        DimensionTiling(2, -1)


def test_balanced_tiling_follows_the_aspect_ratio():
    wide = BalancedTiling(2, overlap=1).grid_for((1, 8, 24))
    assert (wide.height.num_tiles, wide.width.num_tiles) == (1, 2)
    tall = BalancedTiling(2, overlap=1).grid_for((1, 24, 8))
    assert (tall.height.num_tiles, tall.width.num_tiles) == (2, 1)
    assert len(build_tiles((1, 16, 16), BalancedTiling(4, overlap=2))) == 4


# ---- a tiny real transformer and inputs ------------------------------------------------------------------
def tiny_config() -> dict:

    return tiny_transformer_config(audio_channels=32)  # small audio latent: 8 channels x 4 mel bins


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    model = LTXModelConfigurator.from_config(tiny_config()).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            scale = p[0].numel() ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval().requires_grad_(False)


def inputs(amplitude: float, *, seed: int = 1, keyframe: bool = False):
    from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
    from ltx_core.conditioning import VideoConditionByKeyframeIndex
    from ltx_core.model.transformer import Modality
    from ltx_core.tools import AudioLatentTools, VideoLatentTools
    from ltx_core.types import AudioLatentShape, VideoLatentShape

    gen = torch.Generator().manual_seed(seed)
    f, h, w = GRID
    shape = VideoLatentShape(batch=1, channels=16, frames=f, height=h, width=w)
    tools = VideoLatentTools(VideoLatentPatchifier(1), shape, fps=24.0)
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    bump = (torch.sin(hh / h * math.pi) * torch.cos(ww / w * math.pi))[None, None, None]
    latent = torch.randn(1, 16, 1, 1, 1, generator=gen) + amplitude * bump * torch.randn(1, 16, 1, 1, 1, generator=gen)
    state = tools.create_initial_state("cpu", torch.float32, initial_latent=latent.expand(1, 16, f, h, w).clone())
    if keyframe:
        key = torch.randn(1, 16, 1, h, w, generator=gen)
        state = VideoConditionByKeyframeIndex(keyframes=key, frame_idx=8, strength=1.0).apply_to(state, tools)
    mel_bins = tiny_config()["transformer"]["audio_in_channels"] // 8  # 8 latent channels x mel bins
    ashape = AudioLatentShape(batch=1, channels=8, frames=5, mel_bins=mel_bins)
    astate = AudioLatentTools(AudioPatchifier(1), ashape).create_initial_state(
        "cpu", torch.float32, initial_latent=torch.randn(1, 8, 5, mel_bins, generator=gen)
    )
    sigma = torch.full((1,), 0.6)
    ctx = torch.randn(1, 8, 32, generator=gen)
    cmask = torch.ones(1, 8, dtype=torch.int64)
    video = Modality(
        latent=state.latent,
        sigma=sigma,
        timesteps=state.denoise_mask * 0.6,
        positions=state.positions,
        context=ctx,
        context_mask=cmask,
        attention_mask=state.attention_mask,
    )
    audio = Modality(
        latent=astate.latent,
        sigma=sigma,
        timesteps=astate.denoise_mask * 0.6,
        positions=astate.positions,
        context=ctx,
        context_mask=cmask,
    )
    return shape, video, audio


def run_tdp(model, tiling, amplitude, *, keyframe=False, group=None, normalize=True):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    shape, video, audio = inputs(amplitude, keyframe=keyframe)
    wrapper = TiledDataParallelModelWrapper(model, tiling=tiling, group=group, normalize_positions=normalize)
    with torch.no_grad(), wrapper.latent_shape(shape):
        return wrapper(video, audio, BatchedPerturbationConfig.empty(1))


def run_untiled(model, amplitude, *, keyframe=False):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    _, video, audio = inputs(amplitude, keyframe=keyframe)
    with torch.no_grad():
        return model(video, audio, BatchedPerturbationConfig.empty(1))


class Pointwise(torch.nn.Module):
    """A token-local 'model': TDP must reproduce it exactly (only blending and scattering are exercised)."""

    def forward(self, video, audio, perturbations):
        del perturbations
        return torch.tanh(video.latent) * 2 + 1, audio.latent * 3


# ---- single process ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.numerics
def test_pointwise_model_is_reproduced_exactly_with_conditioning_tokens():
    ref_v, ref_a = run_untiled(Pointwise(), 0.5, keyframe=True)
    tiling = TileCountConfig(DimensionTiling(2, 0), DimensionTiling(2, 2))
    out_v, out_a = run_tdp(Pointwise(), tiling, 0.5, keyframe=True)
    assert out_v.shape == ref_v.shape and out_v.shape[1] == 2 * 8 * 12 + 8 * 12
    # a pointwise model sees the same values tiled or not: only the blend (weights summing to 1 within a few
    # u, times outputs of magnitude ~1) can round differently, so 1e-6 is ~10 u
    torch.testing.assert_close(out_v, ref_v, rtol=0, atol=1e-6)
    torch.testing.assert_close(out_a, ref_a, rtol=0, atol=1e-6)  # audio: average of identical outputs


@pytest.mark.numerics
def test_constant_input_matches_untiled(model):
    ref_v, ref_a = run_untiled(model, 0.0)
    out_v, out_a = run_tdp(model, TILING_2x2, 0.0)
    # constant input: every tile computes the untiled values, with matmuls over fewer rows (another MKL
    # blocking, so another fp32 summation order): ~1e-6 through the tiny transformer, 1e-5 with room
    torch.testing.assert_close(out_v, ref_v, rtol=0, atol=1e-5)
    torch.testing.assert_close(out_a, ref_a, rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_smooth_input_matches_untiled_within_tolerance(model):
    ref_v, _ = run_untiled(model, 0.05)
    out_v, _ = run_tdp(model, TILING_2x2, 0.05)
    err = (out_v - ref_v).abs().max().item()
    assert err < 0.05, err  # an approximation (tiles see less context), not rounding: no ISA dependence
    rough_v, _ = run_untiled(model, 1.0)
    rough_out, _ = run_tdp(model, TILING_2x2, 1.0)
    assert (rough_out - rough_v).abs().max().item() > err  # the tolerance is about smoothness, not luck


def test_forward_needs_a_declared_geometry(model):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    _, video, audio = inputs(0.0)
    wrapper = TiledDataParallelModelWrapper(model, tiling=TILING_2x2)
    with pytest.raises(RuntimeError, match="set_latent_shape"):
        wrapper(video, audio, BatchedPerturbationConfig.empty(1))
    with pytest.raises(ValueError, match="fewer than the declared"), wrapper.latent_shape((4, 8, 12)):
        wrapper(video, audio, BatchedPerturbationConfig.empty(1))


def test_shared_weights_model_aliases_storage(tmp_path):
    import json

    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
    from safetensors.torch import save_file

    src = tiny_model(3)
    path = tmp_path / "t.safetensors"
    meta = {"config": json.dumps(tiny_config())}
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path, meta)
    builder = SingleGPUModelBuilder(LTXModelConfigurator, str(path))
    built = builder.build(device=torch.device("cpu"))
    twin = shared_weights_model(builder, built)
    for (name, a), (_, b) in zip(built.named_parameters(), twin.named_parameters(), strict=True):
        assert a.data_ptr() == b.data_ptr(), name
    with torch.no_grad():
        built.proj_out.weight.add_(1.0)
    assert torch.equal(twin.proj_out.weight, built.proj_out.weight)


@pytest.mark.parametrize("keyframe", [False, True])
def test_the_steps_of_a_stage_reuse_one_plan_without_host_reads(model, monkeypatch, keyframe):
    """Three steps with the same positions: the tile plan (indices, weights, positions) is made on the first
    step and reused, so later steps read nothing back from the device (no `.cpu()`; a GPU sync each step
    before) and copy no index or mask to it; a video without conditioning tokens reads nothing at all. The
    outputs are the bits a fresh wrapper gives at every step; a new job (`set_latent_shape`) plans again."""
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    from ltx_mgpu.parallel.pipeline import tiling as tiling_mod

    shape, video, audio = inputs(0.3, keyframe=keyframe)
    tiling = TileCountConfig(DimensionTiling(2, 0), DimensionTiling(2, 2))
    none = BatchedPerturbationConfig.empty(1)
    with torch.no_grad():
        fresh = []
        for _ in range(3):
            one = TiledDataParallelModelWrapper(model, tiling=tiling)
            one.set_latent_shape(shape)
            fresh.append(one(video, audio, none))
        counts = {"cpu": 0, "mask": 0}
        real_cpu, real_mask = torch.Tensor.cpu, tiling_mod.TdpTile.mask

        def counting(name, real):
            def wrapped(*a, **kw):
                counts[name] += 1
                return real(*a, **kw)

            return wrapped

        monkeypatch.setattr(torch.Tensor, "cpu", counting("cpu", real_cpu))
        monkeypatch.setattr(tiling_mod.TdpTile, "mask", counting("mask", real_mask))
        wrapper = TiledDataParallelModelWrapper(model, tiling=tiling)
        wrapper.set_latent_shape(shape)
        per_step = []
        for i in range(3):
            before = dict(counts)
            out = wrapper(video, audio, none)
            per_step.append({k: counts[k] - before[k] for k in counts})
            assert torch.equal(out[0], fresh[i][0]) and torch.equal(out[1], fresh[i][1])
        assert per_step[0] == {"cpu": 1 if keyframe else 0, "mask": 4}
        assert per_step[1] == per_step[2] == {"cpu": 0, "mask": 0}
        wrapper.set_latent_shape(shape)
        wrapper(video, audio, none)
        assert counts["mask"] == 8  # planned again for the new job


# ---- two CPU ranks -----------------------------------------------------------------------------------------
def _rank_tdp(ctx, tiling, amplitude, keyframe):
    import torch.distributed as dist

    out_v, out_a = run_tdp(tiny_model(), tiling, amplitude, keyframe=keyframe, group=dist.group.WORLD)
    return out_v, out_a


def _rank_too_few_tiles(ctx):
    try:
        TiledDataParallelModelWrapper(Pointwise(), tiling=TileCountConfig())
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def world():
    with LocalWorld(2) as w:
        yield w


@pytest.mark.numerics
def test_two_ranks_match_one_process(world, model):
    tiling = TileCountConfig(height=DimensionTiling(2, 2), width=DimensionTiling(3, 1))  # 6 tiles over 2 ranks
    single_v, single_a = run_tdp(model, tiling, 0.3, keyframe=True)
    results = world.run(_rank_tdp, tiling, 0.3, True)
    for out_v, out_a in results:  # the same tiles, summed by an all-reduce in another order: as above, 1e-5
        torch.testing.assert_close(out_v, single_v, rtol=0, atol=1e-5)
        torch.testing.assert_close(out_a, single_a, rtol=0, atol=1e-5)
    assert torch.equal(results[0][0], results[1][0])  # one all-reduce: every rank holds the same bits


def test_too_few_tiles_is_a_clear_error_on_every_rank(world):
    messages = world.run(_rank_too_few_tiles)
    assert all(m is not None and "at least as many tiles as ranks: 1 tile(s) for world size 2" in m for m in messages)
