"""Triton kernels for the elementwise work of an LTX-2 transformer block (`ops.py` says when they run).

Two kernels, one program per token row (the whole row in registers, D <= 16,384):

- `_residual_norm_kernel`: optionally the gated residual `x + y * gate * mask`, then optionally the RMS norm of
  the result (no affine), optionally modulated `* (1 + scale) + shift`. One read of x (and y), one write of each
  output, where eager torch makes 5-9 passes over (B, T, D) bf16 tensors.
- `_norm_rope_kernel`: an attention's q/k RMSNorm (with its weight, over all heads) and then LTX-2's split RoPE
  (each head's first half rotated against its second half), one read and one write of q or k.

Every step is the eager ltx-core expression's, rounded where eager torch rounds: each bf16 op of eager torch
computes in fp32 and rounds once to bf16, and the kernels do the same, step by step (a product of two bf16
numbers is exact in fp32, so `addcmul`'s possible fused multiply-add rounds the same as a multiply and an add;
`enable_fp_fusion=False` keeps Triton from contracting anything else). So the residual, modulation and RoPE
steps are bit-identical to eager torch; only the norm's fp32 mean of squares (its summation order) and rsqrt
differ, by a few fp32 ulps, which flips the bf16 rounding of the normalized value for a few elements
(`ops.py`: `NORM_TOLERANCE` derives what that allows).
"""

# ruff: noqa: ANN001, ANN202 (the kernels' arguments stay untyped: Triton specialises on them)
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton; `ops.py` does not call in here then
    triton = tl = None

__all__ = ["MAX_ROW", "norm_rope_kernel", "residual_norm_kernel"]

MAX_ROW = 16384  #: the widest row one program holds in registers

if triton is not None:

    @triton.jit
    def _bf(v):
        """Round fp32 to bf16 (nearest, ties to even) and widen back: one eager bf16 op's result. By the bits
        (what `cvt.rn.bf16.f32` does on a GPU), because Triton's CPU interpreter truncates in `.to(bfloat16)`;
        the stores then cast values bf16 already holds exactly."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _residual_norm_kernel(
        x_ptr,
        y_ptr,
        g_ptr,
        m_ptr,
        sc_ptr,
        sh_ptr,
        xo_ptr,
        no_ptr,
        T,
        D,
        eps,
        sx,
        sy,
        sgb,
        sgt,
        smb,
        scb,
        sct,
        shb,
        sht,
        sxo,
        sno,
        RESID: tl.constexpr,
        GATE: tl.constexpr,
        MASK: tl.constexpr,
        NORM: tl.constexpr,
        MOD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        b, t = row // T, row % T
        offs = tl.arange(0, BLOCK)
        keep = offs < D
        x = tl.load(x_ptr + row * sx + offs, mask=keep, other=0.0).to(tl.float32)
        if RESID:
            h = tl.load(y_ptr + row * sy + offs, mask=keep, other=0.0).to(tl.float32)
            if GATE:
                h = _bf(h * tl.load(g_ptr + b * sgb + t * sgt + offs, mask=keep, other=0.0).to(tl.float32))
            if MASK:
                h = _bf(h * tl.load(m_ptr + b * smb).to(tl.float32))
            x = _bf(x + h)
            tl.store(xo_ptr + row * sxo + offs, x.to(tl.bfloat16), mask=keep)
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            n = _bf(x * r)
            if MOD:
                scale = tl.load(sc_ptr + b * scb + t * sct + offs, mask=keep, other=0.0).to(tl.float32)
                shift = tl.load(sh_ptr + b * shb + t * sht + offs, mask=keep, other=0.0).to(tl.float32)
                n = _bf(_bf(n * _bf(1.0 + scale)) + shift)
            tl.store(no_ptr + row * sno + offs, n.to(tl.bfloat16), mask=keep)

    @triton.jit
    def _norm_rope_kernel(
        x_ptr,
        w_ptr,
        c_ptr,
        s_ptr,
        o_ptr,
        T,
        eps,
        sx,
        scb,
        sch,
        sct,
        ssb,
        ssh,
        sst,
        so,
        H: tl.constexpr,
        HALF: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        b, t = row // T, row % T
        heads = tl.arange(0, H)[:, None]
        j = tl.arange(0, HALF)[None, :]
        first = heads * (2 * HALF) + j  # (H, HALF): each head's first half; + HALF: its second half
        x1 = tl.load(x_ptr + row * sx + first).to(tl.float32)
        x2 = tl.load(x_ptr + row * sx + first + HALF).to(tl.float32)
        r = 1.0 / tl.sqrt(
            (tl.sum(tl.sum(x1 * x1, axis=1), axis=0) + tl.sum(tl.sum(x2 * x2, axis=1), axis=0)) / (2 * H * HALF) + eps
        )
        n1 = _bf(x1 * r * tl.load(w_ptr + first).to(tl.float32))  # (torch: weight applied in fp32)
        n2 = _bf(x2 * r * tl.load(w_ptr + first + HALF).to(tl.float32))
        if ROPE:
            c = tl.load(c_ptr + b * scb + heads * sch + t * sct + j).to(tl.float32)
            s = tl.load(s_ptr + b * ssb + heads * ssh + t * sst + j).to(tl.float32)
            o1 = _bf(_bf(n1 * c) + (-s) * n2)
            o2 = _bf(_bf(n2 * c) + s * n1)
        else:
            o1, o2 = n1, n2
        tl.store(o_ptr + row * so + first, o1.to(tl.bfloat16))
        tl.store(o_ptr + row * so + first + HALF, o2.to(tl.bfloat16))

    residual_norm_kernel = _residual_norm_kernel
    norm_rope_kernel = _norm_rope_kernel
else:  # pragma: no cover (CPU torch without Triton)
    residual_norm_kernel = norm_rope_kernel = None
