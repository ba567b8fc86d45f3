"""The Triton kernel behind `rowwise.quantize_rows` on CUDA: one program per row, the whole row in
registers (K <= 16,384 for LTX-2: 32-64 fp32 values a thread), so the activation is read once and written
once as fp8. The arithmetic is `rowwise.quantize_rows_eager`'s, step for step: fp32 amax, a power-of-two
scale built from amax's bits, an exact multiply, a clamp and a round-to-nearest-even cast (Hopper's
`cvt.rn.satfinite.e4m3x2.f32`). With `GELU` the tanh-approximated GELU of ltx-core's FeedForward is applied
first (in fp32, as x / (1 + exp(-2u)): `rowwise.gelu_tanh`), so the up projection's output is read once and
never written back as bf16.

Checked without a GPU by compiling for sm_90 ahead of time with Triton 3.9: the plain kernel's PTX is a
bf16->f32 convert, abs, max, `mul.f32` (round to nearest, no flush to zero), the clamp and
`cvt.rn.satfinite.e4m3x2.f32`, i.e. exactly the eager arithmetic; the GELU variant adds `ex2.approx` and
`div.full` (a few ulps from torch's exp and division).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton; `rowwise.quantize_rows` does not call in here then
    triton = tl = None

__all__ = ["quantize_rows_triton"]

if triton is not None:

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, GELU: tl.constexpr):  # noqa: ANN001, ANN202 (Triton specialises on the untyped pointer and integer arguments)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x / (1.0 + tl.exp(-2.0 * u))  # 0.5 x (1 + tanh u); exp overflow gives -0, underflow x
        amax = tl.max(tl.abs(x), axis=0)
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(amax > 0, e, 0)
        e = tl.minimum(tl.maximum(e, -126), 126)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + offs, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(s_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (M, K), last dim contiguous -> (q (M, K) float8_e4m3fn, scale (M, 1) float32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, GELU=gelu, num_warps=warps)
    return q, scale
