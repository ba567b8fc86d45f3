"""The fused elementwise operations of an LTX-2 block: eager definitions (ltx-core's expressions, in its op
order) and their Triton kernels (`triton_block`), picked on CUDA bf16 tensors when Triton imports.

- `residual_norm(x, y, gate, mask, scale, shift)`: `x + y * gate * mask` (each factor optional), then
  `rms_norm(.) * (1 + scale) + shift` (or the plain norm, or none): returns (new x, normed);
- `norm_rope(q, weight, cos, sin, heads)`: `RMSNorm(weight)(q)` then LTX-2's split RoPE.

Shapes: x, y (B, T, D) with contiguous rows; gate, scale, shift broadcastable to (B, T, D) with a contiguous
last dimension (ltx-core's AdaLN values: (B, 1, D) or per token (B, T, D), strided views of one tensor); mask
(B, 1, 1); cos, sin (B or 1, H, T, D/H/2) as ltx-core's `split_freqs_cis` makes them. The kernels launch
one program per token with no host synchronisation and no data-dependent shapes, so they capture into CUDA
graphs; their specialisations depend on the shapes only (compiled on the first, eager, call of a shape).

Numerics (`NORM_TOLERANCE`): the residual, modulation and RoPE steps are bit-identical to eager torch. The norm's
fp32 reciprocal RMS differs from torch's by a few fp32 ulps (another summation order; torch's CUDA RMSNorm may
also round once where its composite rounds twice), so a normalized value can round to the neighbouring bf16
number: one bf16 ulp, at most 2**-7 of the value. The modulation multiplies that by (1 + scale) and the
product's rounding can flip once more, by one ulp of the product (not of the output: a shift that cancels the
product leaves a small output beside a large product's ulp), and the shift's sum once more by one ulp of the
output. So an element differs from eager by at most 2 * 2**-7 * |norm * (1 + scale)| (times 1 + 2**-7 for the
rounded operands) + 2 * 2**-7 * |out| (with slack), plus the smallest normal bf16 for outputs near zero; most
elements are equal.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "NORM_TOLERANCE",
    "fused_available",
    "norm_rope",
    "norm_rope_eager",
    "residual_norm",
    "residual_norm_eager",
]

NORM_TOLERANCE = 2.0**-7  #: one bf16 ulp, relative (see the module docstring)
FORCE_KERNELS = False  #: tests: run the kernels on CPU tensors too (under TRITON_INTERPRET=1)


@functools.cache
def fused_available() -> bool:
    """Triton imports (CUDA builds of torch ship it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def residual_norm_eager(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ltx-core's expressions: `x + y * gate * mask`, `rms_norm(x) * (1 + scale) + shift`."""
    if y is not None:
        if gate is not None:
            y = y * gate
        if mask is not None:
            y = y * mask
        x = x + y
    if not norm:
        return x, None
    n = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
    if scale is not None:
        n = n * (1 + scale) + shift
    return x, n


def _rows_ok(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.bfloat16 and t.stride(-1) == 1) for t in ts)


def _bt_strides(t: torch.Tensor, shape: torch.Size) -> tuple[int, int]:
    """(batch, token) strides of `t` broadcast to (B, T, D) (0 where broadcast)."""
    e = t.expand(shape)
    return e.stride(0), e.stride(1)


def residual_norm(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: bool = True,
    force_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`residual_norm_eager`, as one Triton kernel on CUDA bf16 inputs (`force_kernel`: also on the CPU, for
    Triton's interpreter in tests)."""
    from .triton_block import MAX_ROW, residual_norm_kernel

    use = (x.is_cuda or force_kernel or FORCE_KERNELS) and fused_available() and x.dim() == 3 and x.shape[-1] <= MAX_ROW
    use = use and _rows_ok(x, y, gate, scale, shift) and (mask is None or mask.numel() == x.shape[0])
    if not use or (y is None and not norm) or (scale is None) != (shift is None):
        return residual_norm_eager(x, y, gate, mask, scale, shift, eps=eps, norm=norm)
    import triton

    b, t, d = x.shape
    x = x.contiguous()
    y = None if y is None else y.expand(x.shape).contiguous()  # (no copies for the block's own tensors)
    xo = torch.empty_like(x) if y is not None else x
    no = torch.empty_like(x) if norm else x
    dummy = x
    sg = _bt_strides(gate, x.shape) if gate is not None else (0, 0)
    sc = _bt_strides(scale, x.shape) if scale is not None else (0, 0)
    sh = _bt_strides(shift, x.shape) if shift is not None else (0, 0)
    m = None if mask is None else mask.reshape(-1).to(torch.bfloat16)
    if b * t:
        residual_norm_kernel[(b * t,)](
            x,
            dummy if y is None else y,
            dummy if gate is None else gate,
            dummy if m is None else m,
            dummy if scale is None else scale,
            dummy if shift is None else shift,
            xo,
            no,
            t,
            d,
            float(eps),
            d,
            d,
            *sg,
            0 if m is None else m.stride(0),
            *sc,
            *sh,
            d,
            d,
            RESID=y is not None,
            GATE=gate is not None,
            MASK=m is not None,
            NORM=norm,
            MOD=scale is not None,
            BLOCK=triton.next_power_of_2(d),
            num_warps=4 if d <= 2048 else 8,
            enable_fp_fusion=False,
        )
    return xo, (no if norm else None)


def norm_rope_eager(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    heads: int,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """ltx-core's `q_norm(q)` then `apply_split_rotary_emb(q, (cos, sin))`, in its op order."""
    n = torch.nn.functional.rms_norm(q, (q.shape[-1],), weight=weight, eps=eps)
    if cos is None:
        return n
    b, t, _ = n.shape
    s = n.reshape(b, t, heads, 2, -1).swapaxes(1, 2)  # (B, H, T, 2, D/2): the halves of each head
    out = s * cos.unsqueeze(-2)
    out[..., :1, :].addcmul_(-sin.unsqueeze(-2), s[..., 1:, :])
    out[..., 1:, :].addcmul_(sin.unsqueeze(-2), s[..., :1, :])
    return out.swapaxes(1, 2).reshape(b, t, -1)


def norm_rope(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    heads: int,
    *,
    eps: float = 1e-6,
    force_kernel: bool = False,
) -> torch.Tensor:
    """`norm_rope_eager` as one Triton kernel on CUDA bf16 inputs with power-of-two heads and head halves."""
    from .triton_block import norm_rope_kernel

    b, t, d = q.shape
    half = d // heads // 2
    pow2 = heads & (heads - 1) == 0 and half & (half - 1) == 0 and half >= 1 and 2 * half * heads == d
    use = (q.is_cuda or force_kernel or FORCE_KERNELS) and fused_available() and pow2 and _rows_ok(q, weight, cos, sin)
    if not use or (cos is not None and (cos.dim() != 4 or cos.shape[-1] != half)):
        return norm_rope_eager(q, weight, cos, sin, heads, eps=eps)
    q = q.contiguous()
    out = torch.empty_like(q)
    if cos is not None:
        cos, sin = cos.expand(b, heads, t, half), sin.expand(b, heads, t, half)
        sc, ss = (cos.stride(0), cos.stride(1), cos.stride(2)), (sin.stride(0), sin.stride(1), sin.stride(2))
    else:
        sc = ss = (0, 0, 0)
    if b * t:
        norm_rope_kernel[(b * t,)](
            q,
            weight.contiguous(),
            q if cos is None else cos,
            q if sin is None else sin,
            out,
            t,
            float(eps),
            d,
            *sc,
            *ss,
            d,
            H=heads,
            HALF=half,
            ROPE=cos is not None,
            num_warps=8 if d > 2048 else 4,
            enable_fp_fusion=False,
        )
    return out
