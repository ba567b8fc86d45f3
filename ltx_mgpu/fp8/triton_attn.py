"""The elementwise kernels around the FP8 attention (`attention.quantize` / `attention.dequantize` on CUDA):
a per-tensor e4m3 cast by a power-of-two scale read from the device (one read of the bf16 tensor, one
e4m3 write: eager torch would make an fp32 copy and three more passes), and the output's widening back (with
the value shift added back in the same pass: `attention` subtracts v's mean before the cast).

The arithmetic is the eager code's: fp32 `x * inv_scale` (exact: a power of two), clamp to +-448, a
round-to-nearest-even cast (`cvt.rn.satfinite.e4m3x2.f32` on Hopper), so the bits equal
`attention.quantize`'s eager path (tests/test_fp8_attention_gpu.py).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton; callers use the eager code then
    triton = tl = None

__all__ = ["dequantize_triton", "quantize_triton", "triton_available"]

BLOCK = 4096


@functools.cache
def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, inv_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202 (Triton specialises on untyped arguments)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        inv = tl.load(inv_ptr)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(q_ptr + offs, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _dequantize_kernel(q_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(scale_ptr)
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (q * s).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequantize_shift_kernel(q_ptr, y_ptr, scale_ptr, shift_ptr, n, channels, per_row, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(scale_ptr)
        m = tl.load(shift_ptr + (offs // per_row) * channels + offs % channels, mask=mask, other=0.0)
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (q * s + m.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def quantize_triton(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x * inv_scale)) with the shape of `x` (copied first if not contiguous)."""
    x = x if x.is_contiguous() else x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    if n:
        inv = inv_scale.reshape(1).to(torch.float32)
        _quantize_kernel[(triton.cdiv(n, BLOCK),)](x, q, inv, n, BLOCK=BLOCK, num_warps=8)
    return q


def dequantize_triton(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """`q * scale` (`+ shift`, one rounding) in `dtype` with the shape of `q`: (B, T, C) when `shift`,
    (B, 1, C), is given (a value per batch row and channel, the same for every token)."""
    q = q if q.is_contiguous() else q.contiguous()
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    n = q.numel()
    if n:
        s = scale.reshape(1).to(torch.float32)
        if shift is None:
            _dequantize_kernel[(triton.cdiv(n, BLOCK),)](q, y, s, n, BLOCK=BLOCK, num_warps=8)
        else:
            channels = q.shape[-1]
            m = shift.reshape(q.shape[0], channels).contiguous()
            grid = (triton.cdiv(n, BLOCK),)
            _dequantize_shift_kernel[grid](q, y, s, m, n, channels, n // q.shape[0], BLOCK=BLOCK, num_warps=8)
    return y
