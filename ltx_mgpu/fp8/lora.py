"""LoRA fusion into `Fp8Linear` weights: fused, then re-quantized.

ltx-core's `apply_loras` fuses into its own scaled-fp8 layout (a transposed (in, out) weight with one scale
per tensor), not into ours ((out, in), one scale per output channel), so the LoRA tracker hands our layers
here. The clean e4m3 weight is dequantized exactly (fp32), the deltas `strength * B @ A` are added in fp32,
and the sum is quantized again per output channel. The tracker always restores the clean e4m3 bytes and
scales before fusing, so swapping LoRAs never compounds rounding; a LoRA costs nothing per step (no extra
bf16 GEMM), at the price of one e4m3 rounding of the fused weight, the same rounding the base weights got.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rowwise import E4M3, quantize_weight

__all__ = ["fuse_rowwise", "is_rowwise_fp8"]


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
    strength)]; the inputs are not modified."""
    fused = weight.float() * scale.float().view(-1, 1)
    for a, b, strength in factors:
        fused += (b.to(fused.device, torch.float32) * float(strength)) @ a.to(fused.device, torch.float32)
    return quantize_weight(fused)
