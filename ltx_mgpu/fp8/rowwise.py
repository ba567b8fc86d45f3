"""Per-row (per-token) FP8 e4m3 quantization of activations, and per-output-channel quantization of weights.

Activations: each row `x[i, :]` gets a power-of-two scale `s_i = 2**e_i`, the smallest with
`max|x[i, :]| / s_i <= 448` (e4m3's largest finite value), and `q[i, :] = e4m3(clamp(x[i, :] / s_i))` with
round-to-nearest-even. Why a power of two and not `amax / 448`: dividing by a power of two is exact, so the
only rounding in the whole step is the final cast to e4m3, and every implementation of it (the Triton kernel
on a GPU, the eager torch code below on any device) produces the same bits from the same input. A scale of
exactly `amax / 448` would need an fp32 division whose rounding differs between a kernel's fast reciprocal
and torch's IEEE division. The cost is at most one binade of headroom (the row's largest value lands in
(224, 448] instead of at 448): e4m3's relative rounding is the same in every normal binade, so only values
near the subnormal range (below 2**-6 of the scale) lose a bit.

`e_i` comes from the fp32 bits of `amax`: with amax = 1.f * 2**(E - 127) and 448 = 1.75 * 2**8,
`e = E - 135 + (f > 0.75)`, clamped to [-126, 126] so that both `2**e` and `2**-e` are normal fp32 numbers.
A row of zeros gets e = 0.

Weights: per output channel, scale `amax / 448`, `q = e4m3(clamp(w / scale))`, both as IEEE (correctly
rounded) fp32 divisions, so that the LoRA fusion kernel (`triton_lora`, `div_rn`) makes the same bits. The 448
is a tensor, not a Python number: on CUDA, torch turns `tensor / python_scalar` (or a 0-dim CPU tensor) into a
multiplication by the fp32 reciprocal, which is off by one ulp for some amax; on the CPU both are exact.

The fused Triton kernels (`triton_rows`) implement the same arithmetic; `quantize_rows` picks them on CUDA
when Triton imports and falls back to the eager code everywhere else.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "E4M3_MAX",
    "gelu_tanh",
    "quantize_rows",
    "quantize_rows_eager",
    "quantize_weight",
    "triton_available",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  #: torch.finfo(torch.float8_e4m3fn).max
_MANTISSA_1_75 = 0x600000  #: the fp32 mantissa field of 1.75 (448 = 1.75 * 2**8)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (ltx-core's FeedForward), in the input's dtype (fp32 here), written as
    x * sigmoid(2u) = x / (1 + exp(-2u)) (the same function as 0.5 x (1 + tanh u), without its cancellation
    for negative x) with the very expression the Triton kernel evaluates."""
    u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return x / (1.0 + torch.exp(-2.0 * u))


def _pow2_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as exact powers of two for fp32 `amax` (see the module docstring)."""
    bits = amax.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > _MANTISSA_1_75).to(torch.int32)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-126, 126)
    return ((e + 127) << 23).view(torch.float32), ((127 - e) << 23).view(torch.float32)


def quantize_rows_eager(x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (M, K) -> (q (M, K) float8_e4m3fn, scale (M, 1) float32) with `x ~= q * scale` row by row;
    `gelu`: quantize gelu_tanh(x) instead (what the feed-forward's down projection consumes)."""
    xf = x.float()
    if gelu:
        xf = gelu_tanh(xf)
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale, inv = _pow2_scales(amax)
    q = (xf * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


@functools.cache
def triton_available() -> bool:
    """Triton imports (it ships with CUDA builds of torch; CPU wheels lack it, the dev setup adds it for the
    interpreter tests). Callers use the kernels on CUDA tensors only."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_rows(x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_eager`, fused into one Triton kernel (one read of x, one fp8 write) on CUDA."""
    if x.is_cuda and triton_available():
        from .triton_rows import quantize_rows_triton

        return quantize_rows_triton(x, gelu=gelu)
    return quantize_rows_eager(x, gelu=gelu)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (N, K) -> (q (N, K) float8_e4m3fn, scale (N,) float32), `w ~= q * scale[:, None]`."""
    return quantize_weight_(w.to(torch.float32, copy=True))


def quantize_weight_(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight` of an fp32 `wf` that it may overwrite (divided and clamped in place): the same
    IEEE operations, so the same bits, without two full-size fp32 temporaries (a LoRA swap re-quantizes
    every fused weight)."""
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))  # (see top)
    q = wf.div_(scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale
