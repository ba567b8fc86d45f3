"""The Triton kernel behind `lora.fuse_rowwise` on CUDA: a LoRA fused into a per-row e4m3 weight in one pass over
the weight, with no full-size fp32 temporary.

The eager fusion (`lora.fuse_rowwise_eager`) dequantizes the whole weight to fp32, adds each bf16 delta
`strength * B @ A`, then re-quantizes through `rowwise.quantize_weight_`: about a dozen full-size fp32 passes
per weight, 0.41 s for the 19B transformer's stage-2 LoRA (rank 384) on one H200 against 0.10 s for the same
fusion into bf16 weights (docs/performance.md). Here the deltas are made exactly as the eager code makes them
(the same torch GEMM, rounded to bf16: ltx-core's `_prepare_deltas` for fp8 weights), and then one program per
output row holds the whole row in registers (K <= 16,384 for LTX-2, as `triton_rows` does): it dequantizes the
row's e4m3 bytes, adds the deltas in fp32 in factor order, takes the row's amax, and writes the e4m3 bytes and
the new scale. Per element: the delta written once by the GEMM and read once, the weight read and written as one
byte each, against about 58 bytes in the eager code.

The arithmetic is the eager code's, step for step, so the result is bit-identical on the same device: `q * scale`
in fp32, each bf16 delta added in fp32, `amax / 448` and `fused / scale` as IEEE divisions (`div_rn`), a clamp and
a round-to-nearest-even cast, compiled without fused multiply-adds (`enable_fp_fusion=False`: with Triton's
default contraction an sm_90 build of the fused-delta kernel this replaced had 16 `fma.rn` where the eager code
rounds twice). One exception: Triton's divisions flush subnormals (`div.rn.ftz`), which only a row whose amax is
below 2**-126 * 448 would meet. Checked on the CPU through Triton's interpreter (tests/test_fp8_lora_kernel.py:
bit-identical to the eager code up to the final cast, which the interpreter emulates wrongly) and on a GPU by
tests/test_fp8_gpu.py.
"""

# ruff: noqa: ANN001, ANN202 (the kernel's arguments stay untyped: Triton specialises on them)
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton; `lora.fuse_rowwise` does not call in here then
    triton = tl = None

__all__ = ["MAX_ROW", "fuse_rowwise_triton", "lora_deltas"]

MAX_ROW = 16384  #: the widest row one program holds in registers (LTX-2's widest input: the feed-forward's 16,384)

if triton is not None:

    @triton.jit
    def _fuse_rows_kernel(
        w_ptr,
        s_ptr,
        d_ptr,
        q_ptr,
        so_ptr,
        K,
        stride_w,
        stride_df,
        stride_dn,
        stride_q,
        NF: tl.constexpr,
        BLOCK: tl.constexpr,
        CAST: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        w = tl.load(w_ptr + row * stride_w + offs, mask=mask, other=0.0)
        fused = w.to(tl.float32) * tl.load(s_ptr + row)
        for f in tl.static_range(NF):
            fused += tl.load(d_ptr + f * stride_df + row * stride_dn + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(fused), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = tl.math.div_rn(fused, tl.full([BLOCK], 1.0, tl.float32) * scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if CAST:
            y = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(q_ptr + row * stride_q + offs, y, mask=mask)
        tl.store(so_ptr + row, scale)


def lora_deltas(factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]], device: torch.device) -> torch.Tensor:
    """(F, N, K) bf16: each factor's `strength * B @ A`, made exactly as `lora.fuse_rowwise_eager` makes it."""
    return torch.stack(
        [torch.matmul(b.to(device) * float(strength), a.to(device)).to(torch.bfloat16) for a, b, strength in factors]
    )


def fuse_rowwise_triton(
    weight: torch.Tensor,
    scale: torch.Tensor,
    factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
    *,
    uncast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora.fuse_rowwise` for an (N, K) e4m3 weight whose rows are contiguous; the inputs are not modified.
    `uncast`: return the clamped fp32 values the e4m3 cast would round (tests: Triton's CPU interpreter emulates
    that cast wrongly where rounding carries into the exponent; on a GPU it is one `cvt.rn.satfinite` each)."""
    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.float32 if uncast else weight.dtype, device=weight.device)
    new_scale = torch.empty((n,), dtype=torch.float32, device=weight.device)
    if n == 0 or k == 0:
        return q, new_scale
    deltas = lora_deltas(factors, weight.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    scale = scale.to(torch.float32).contiguous()
    with torch.cuda.device(weight.device) if weight.is_cuda else contextlib.nullcontext():  # (its device's stream)
        _fuse_rows_kernel[(n,)](
            weight,
            scale,
            deltas,
            q,
            new_scale,
            k,
            weight.stride(0),
            deltas.stride(0),
            deltas.stride(1),
            q.stride(0),
            NF=len(factors),
            BLOCK=block,
            CAST=not uncast,
            num_warps=warps,
            enable_fp_fusion=False,
        )
    return q, new_scale
