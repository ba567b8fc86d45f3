"""LoRA fusion into `Fp8Linear` weights: fused, then re-quantized.

ltx-core's `apply_loras` fuses into its own scaled-fp8 layout (a transposed (in, out) weight with one scale
per tensor), not into ours ((out, in), one scale per output channel), so the LoRA tracker hands our layers
here. The clean e4m3 weight is dequantized exactly (fp32), the deltas are made as ltx-core makes them for its
own fp8 weights (`strength * B @ A` in the LoRA's dtype, then bf16: its `_prepare_deltas`) and added in fp32,
and the sum is quantized again per output channel, in place. Why not fp32 deltas: a bf16 delta is rounded
to 2**-9 of its own size, and the fused weight is then rounded to e4m3 (2**-4 of the weight's size), so
the finer product changes nothing the reference keeps, while it costs an fp32 GEMM (no tensor cores) and two
full-size fp32 temporaries per weight (on an H200 at 19B, fp32 deltas made the two-stage runner's stage-2 swap
into fp8 weights 0.66 s against 0.11 s into bf16 ones). The tracker always restores the clean
e4m3 bytes and scales before fusing, so swapping LoRAs never compounds rounding; a LoRA costs nothing per step (no extra
bf16 GEMM), at the price of one e4m3 rounding of the fused weight, the same rounding the base weights got.

On CUDA with Triton, `fuse_rowwise` runs the same arithmetic as one kernel that never materialises the fp32
weight (`triton_lora`: the same torch GEMM for the deltas, then one program per row, the weight read and
written once as bytes, instead of about a dozen fp32 passes); elsewhere, or for factors that are not bf16,
the eager code below.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rowwise import E4M3, quantize_weight_, triton_available

__all__ = ["fuse_rowwise", "fuse_rowwise_eager", "is_rowwise_fp8"]


def is_rowwise_fp8(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """A (N, K) e4m3 weight with one fp32 scale per output channel (`Fp8Linear`'s layout)."""
    return (
        weight.dtype == E4M3
        and weight.dim() == 2
        and scale is not None
        and scale.dim() == 1
        and scale.shape[0] == weight.shape[0]
    )


@torch.no_grad()
def fuse_rowwise(
    weight: torch.Tensor, scale: torch.Tensor, factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of `weight * scale[:, None] + sum(strength * B @ A)` for `factors` [(A (r, K), B (N, r),
    strength)]; the inputs are not modified. The Triton kernel on CUDA (see the module docstring)."""
    if (
        factors
        and weight.is_cuda
        and weight.stride(-1) == 1
        and triton_available()
        and all(a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 for a, b, _ in factors)
    ):
        from .triton_lora import MAX_ROW, fuse_rowwise_triton

        if weight.shape[-1] <= MAX_ROW:  # (one row per program, in registers)
            return fuse_rowwise_triton(weight, scale, factors)
    return fuse_rowwise_eager(weight, scale, factors)


@torch.no_grad()
def fuse_rowwise_eager(
    weight: torch.Tensor, scale: torch.Tensor, factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fuse_rowwise` in eager torch, on any device: the definition the kernels are checked against."""
    fused = weight.to(torch.float32).mul_(scale.to(torch.float32).view(-1, 1))
    for a, b, strength in factors:
        delta = torch.matmul(b.to(fused.device) * float(strength), a.to(fused.device))
        fused.add_(delta.to(torch.bfloat16))
    return quantize_weight_(fused)
