"""The FP8 attention kernels on a GPU (skipped without CUDA, without Hopper, or without their library):
cuDNN's FP8 SDPA (nvidia-cudnn-frontend) and SageAttention against float32 attention at the tolerances
tests/test_fp8_attention.py derives, the Triton casts against the eager definition bit for bit, and a
CUDA-graph replay against the eager call.

cuDNN FP8 must land within 0.3 to 1.0 times the e4m3 prediction (the upper model of tests/test_fp8_attention.py;
0.3 rather than the emulation's 0.5 leaves room for the kernel rounding in fewer places than the emulation
assumes; bf16 attention would sit near 0.03 of it). SageAttention (INT8 q and k with one scale per block of
tokens, fp16 P.V): a block's amax is at most ~5 sigma of ~16k Gaussian values, so the step is 5 sigma / 127
and the per-element relative RMS 5 / (127 sqrt(12)) ~ 0.011; q and k in quadrature, times a score gain below
2 (the fp8 prediction's own gain is ~1.2): <= 0.032, checked against 0.04.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.fp8 import attention as fa
from tests.test_fp8_attention import predicted_rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

SHAPES = [(1, 1536, 32, 128), (2, 1536, 32, 128), (1, 6144, 8, 128), (1, 1000, 4, 128)]  # (8: 32 heads over 4 ranks)


def _qkv(b: int, t: int, h: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """ltx-core's q and k (RMS-normed over H*D with a weight in [0.5, 1.5]) and v, (B, T, H*D) bf16."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = torch.nn.RMSNorm(h * d, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h * d, generator=gen, device="cuda") + 0.5)
        q, k = (norm(torch.randn(b, t, h * d, generator=gen, device="cuda")) for _ in range(2))
    v = torch.randn(b, t, h * d, generator=gen, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), norm


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, t, hidden = x.shape
    return x.view(b, t, h, hidden // h).transpose(1, 2).double()


def _check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int) -> tuple[float, float]:
    """(relative error against float64 attention, the e4m3 prediction with the bf16 output's own rounding),
    over 256 evenly spaced queries."""
    rows = torch.linspace(0, q.shape[1] - 1, 256, device="cuda").round().long()
    qh, kh, vh = _heads(q, h)[:, :, rows], _heads(k, h), _heads(v, h)
    ref = torch.softmax(qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5, dim=-1) @ vh
    got = _heads(out, h)[:, :, rows]
    predicted = predicted_rel_error(qh[:, :2], kh[:, :2], vh[:, :2], bf16_out=out.dtype == torch.bfloat16)
    return ((got - ref).norm() / ref.norm()).item(), predicted


def test_triton_casts_are_bit_identical_to_eager():
    from ltx_mgpu.fp8.triton_attn import dequantize_triton, quantize_triton

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(3, 5000, generator=gen, device="cuda") * torch.logspace(-14, 9, 5000, base=2.0, device="cuda")
    x = x.bfloat16()
    scale, inv = fa.pow2_scales(x.abs().amax().float())
    eager = (x.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = quantize_triton(x, inv)
    assert torch.equal(got.view(torch.uint8), eager.view(torch.uint8))
    assert torch.equal(dequantize_triton(got, scale, torch.bfloat16), (eager.float() * scale).bfloat16())
    o8, shift = got.view(3, 50, 100), torch.randn(3, 1, 100, generator=gen, device="cuda").bfloat16()
    shifted = (o8.float() * scale + shift.float()).bfloat16()  # (the eager `dequantize` with a shift)
    assert torch.equal(dequantize_triton(o8, scale, torch.bfloat16, shift), shifted)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("static_qk", [True, False])
def test_cudnn_fp8_attention_is_within_the_e4m3_prediction(shape, static_qk):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    b, t, h, d = shape
    q, k, v, norm = _qkv(b, t, h, d)
    attn = fa.Fp8SelfAttention(None, norm if static_qk else None, norm if static_qk else None, "cudnn")
    with torch.no_grad():
        out = attn(q, k, v, h)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err, predicted = _check(out, q, k, v, h)
    print(f"cudnn-fp8 {shape} static_qk={static_qk}: rel err {err:.4f}, e4m3 prediction {predicted:.4f}")
    assert 0.3 * predicted <= err <= predicted, (err, predicted)


def test_cudnn_with_the_value_shift_keeps_a_common_component_out_of_the_rounding():
    """v with a common component (as the synthetic 19B block's): cuDNN with the shift lands within the shifted
    prediction and well under the unshifted call on the same inputs (module docstring of ltx_mgpu/fp8/attention.py)."""
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    q, k, v, norm = _qkv(1, 6144, 8, 128, seed=11)
    v = (v.float() + 2.0).bfloat16()
    errors = {}
    for smooth in (True, False):
        with torch.no_grad():
            out = fa.Fp8SelfAttention(None, norm, norm, "cudnn", smooth_v=smooth)(q, k, v, 8)
        errors[smooth], predicted = _check(out, q, k, v, 8)
        print(f"cudnn-fp8 offset v, smooth_v={smooth}: rel err {errors[smooth]:.4f}")
    assert 0.3 * predicted <= errors[True] <= predicted, (errors, predicted)
    assert errors[True] < errors[False] / 3, errors


def test_cudnn_fp8_attention_replays_from_a_cuda_graph():
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    q, k, v, norm = _qkv(1, 1536, 32, 128, seed=5)
    attn = fa.Fp8SelfAttention(None, norm, norm, "cudnn")
    with torch.no_grad():
        eager = attn(q, k, v, 32)  # the first call builds the cuDNN graph, eagerly
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attn(q, k, v, 32)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attn(q, k, v, 32)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_sage_int8_attention_is_within_its_int8_bound():
    pytest.importorskip("sageattention", reason="sageattention is not installed")
    q, k, v, _ = _qkv(1, 6144, 32, 128, seed=7)
    with torch.no_grad():
        out = fa.Fp8SelfAttention(None, backend="sage")(q, k, v, 32)
    err, _ = _check(out, q, k, v, 32)
    print(f"sage-int8 1x6144x32x128: rel err {err:.4f}")
    assert err <= 0.04, err


def test_auto_takes_bf16_below_the_token_floor_and_fp8_above_it():
    """The production backend (`auto`) runs the bf16 attention it replaced below `FP8_ATTENTION_MIN_TOKENS` keys
    (bit for bit the fallback's output) and cuDNN FP8 from there on (within the e4m3 prediction, as above)."""
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    from ltx_core.model.transformer.attention import AttentionFunction

    bf16 = AttentionFunction.PYTORCH
    below, above = fa.FP8_ATTENTION_MIN_TOKENS // 2, fa.FP8_ATTENTION_MIN_TOKENS
    for t in (below, above):
        q, k, v, norm = _qkv(1, t, 8, 128, seed=t)
        with torch.no_grad():
            out, ref = fa.Fp8SelfAttention(bf16, norm, norm)(q, k, v, 8), bf16(q, k, v, 8)
        if t == below:
            assert torch.equal(out, ref)
        else:
            err, predicted = _check(out, q, k, v, 8)
            assert not torch.equal(out, ref) and 0.3 * predicted <= err <= predicted, (err, predicted)
