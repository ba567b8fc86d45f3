"""How far `quantization="fp8-mm"` moves the LTX-2 transformer from its unquantized self, on CPU through the
emulation (the same e4m3 roundings as the GPU path: tests/test_fp8.py; only the fp32 summation order
differs), with the tiny checkpoint's weights and activations of realistic scale.

The tolerances come from e4m3's 3 mantissa bits, not from measurement:
- one rounding to nearest moves a normal value by at most half a step, 2**-4 of the value at the bottom of
  a binade; over a binade the relative error is spread up to that, so its RMS is at most 2**-4 / sqrt(3)
  (~0.036; it equals that only if every value sat at the bottom of its binade);
- a linear's output element is a dot product of n terms x_k w_k, each carrying the independent relative
  errors of x_k and w_k: the error sum_k x_k w_k (dx_k + dw_k) has RMS sqrt(sum_k (x_k w_k)^2) *
  sqrt(2) * 0.036, and a sum of n random-sign terms is itself ~ sqrt(sum_k (x_k w_k)^2): both grow as
  sqrt(n), so a linear's relative error is ~ sqrt(2) * 0.036 = 0.051 for every n;
- each branch of a block is two quantized linears in series (q/k/v then out; up then down), whose
  independent errors add in quadrature: sqrt(2) * 0.051 = 0.072 (softmax over RMS-normalised q and k and
  the GELU have gains of order 1). The block's update (output - input, the sum of its branches) therefore
  differs by <= 0.072 of itself, and the block output by 0.072 * |update| / |output|, below the 3% we
  target whenever the update is under ~40% of the residual stream.
Each test also asserts the error is above 2**-8 (bf16's own rounding), so it fails if fp8 is not in effect.

Run in fp32 (the bf16 file's weights upcast) so the difference is fp8's alone: in bf16 the output's own
rounding of x + update would dominate the update's error wherever the residual stream is large.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from ltx_mgpu.fp8 import Fp8Linear, convert_linears
from ltx_mgpu.runners.ltx2 import components as comp

pytestmark = pytest.mark.numerics

LINEAR = 2**0.5 * 2.0**-4 / 3**0.5  # one quantized linear: sqrt(2) * RMS(e4m3 rounding) ~ 0.051
BRANCH = 2**0.5 * LINEAR  # two in series ~ 0.072
FLOOR = 2.0**-8  # below this, fp8 did not happen


@pytest.fixture(scope="module")
def models():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    tb = comp.transformer_builder(str(ensure_tiny_ltx2().checkpoint))
    ref = tb.build(device=torch.device("cpu"), dtype=torch.float32).eval()
    fp8 = convert_linears(copy.deepcopy(ref), quantize=True)  # the recipe: block 0 stays, block 1 converts
    assert not any(isinstance(m, Fp8Linear) for m in fp8.transformer_blocks[0].modules())
    assert sum(isinstance(m, Fp8Linear) for m in fp8.transformer_blocks[1].modules()) == 28
    return tb.model_config(), ref, fp8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _realistic(x: torch.Tensor) -> torch.Tensor:
    """Unit-RMS tokens with one channel in 32 at 20x (DiTs carry outlier channels of 10-100x the median)."""
    x = x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()
    x[..., ::32] *= 20.0
    return x


@pytest.mark.parametrize("tokens", [1536, 6144])
def test_block_update_error_is_within_two_linears_of_e4m3(models, tokens):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    from bench.block import block_inputs

    cfg, ref, fp8 = models
    vargs, aargs, _, _ = block_inputs(ref, cfg, tokens, torch.device("cpu"), torch.float32)
    vargs = vargs.__class__(**{**vargs.__dict__, "x": _realistic(vargs.x)})
    aargs = aargs.__class__(**{**aargs.__dict__, "x": _realistic(aargs.x)})
    pert = BatchedPerturbationConfig.empty(1)
    with torch.inference_mode():
        rv, ra = ref.transformer_blocks[1](vargs, aargs, pert)
        qv, qa = fp8.transformer_blocks[1](vargs, aargs, pert)
    errors = {
        "video update": _rel(qv.x - vargs.x, rv.x - vargs.x),
        "audio update": _rel(qa.x - aargs.x, ra.x - aargs.x),
        "video output": _rel(qv.x, rv.x),
    }
    ratio = ((rv.x - vargs.x).norm() / rv.x.norm()).item()
    assert FLOOR < errors["video update"] <= BRANCH and FLOOR < errors["audio update"] <= BRANCH, errors
    assert errors["video output"] <= BRANCH * ratio * 1.01 and errors["video output"] <= 0.03, (errors, ratio)


def test_denoised_latent_moves_by_at_most_one_branch_error(models):
    """Four Euler steps of the distilled schedule's tail through the whole tiny transformer (block 0 bf16
    recipe, block 1 fp8, projections unquantized): each velocity differs by at most block 1's update error
    (<= BRANCH of it, the only quantized part), and the final latent, noise plus a sum of steps, by no more
    than that of the integrated velocities."""
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    from bench.block import modalities

    cfg, ref, fp8 = models
    sigmas = [0.909375, 0.725, 0.421875, 0.0]
    pert = BatchedPerturbationConfig.empty(1)
    finals = []
    for model in (ref, fp8):
        video, audio = modalities(cfg, 1536, torch.device("cpu"), torch.float32, sigma=sigmas[0])
        start = video.latent
        with torch.inference_mode():
            for s, s_next in itertools.pairwise(sigmas):
                video = video.__class__(**{**video.__dict__, "sigma": torch.full((1,), s),
                                           "timesteps": torch.full_like(video.timesteps, s)})  # fmt: skip
                audio = audio.__class__(**{**audio.__dict__, "sigma": torch.full((1,), s),
                                           "timesteps": torch.full_like(audio.timesteps, s)})  # fmt: skip
                v, a = model(video, audio, pert)
                video = video.__class__(**{**video.__dict__, "latent": video.latent + (s_next - s) * v})
                audio = audio.__class__(**{**audio.__dict__, "latent": audio.latent + (s_next - s) * a})
        finals.append((start, video.latent, audio.latent))
    (start, ref_v, ref_a), (_, q_v, q_a) = finals
    moved = _rel(q_v - start, ref_v - start)  # the integrated velocities
    assert FLOOR < moved <= BRANCH, moved
    assert _rel(q_v, ref_v) <= BRANCH and _rel(q_a, ref_a) <= BRANCH
