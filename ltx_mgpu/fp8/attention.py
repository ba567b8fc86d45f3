"""FP8 e4m3 attention for LTX-2's video self-attention (`quantization="fp8-mm+attn"`; docs/runners.md).

`Fp8SelfAttention` is an ltx-core `AttentionCallable` ((q, k, v, heads, mask) -> out, q/k/v `(B, T, H*D)`)
that quantizes q, k and v to e4m3 with one scale per tensor and runs the attention on FP8 tensor cores:
cuDNN's FP8 SDPA through `nvidia-cudnn-frontend` (`cudnn_attention.py`) on CUDA, and an emulation in fp32
(`emulate_fp8_attention`: the same roundings, another summation order) elsewhere, which the CPU tests and
the tiny renders use. It sits where ltx-core's attention function sits; under SP it is the `inner` of
`parallel.sp.attention.All2AllAttention`, so it runs on the rank's heads after the head exchange
(`install_fp8_attention` handles both orders of the module ops).

Scales (all exact powers of two, chosen as `rowwise` chooses them: the smallest 2**e with amax / 2**e <= 448,
so dividing by them is exact and the only rounding is the cast to e4m3, round to nearest even):
- q and k: from where they are produced, not from their values. ltx-core normalises q and k by RMSNorm
  over the whole inner dimension n = H*D before RoPE, so |x_i / rms(x)| <= sqrt(n), and a RoPE rotation
  mixes two such elements into at most their pair's norm: |q_i| <= sqrt(n) * max|q_norm.weight| (eps only
  shrinks it). That bound is read from the norm's weight (4,096 values, on the device, every call: a LoRA
  or a reload is followed) and needs no pass over q or k, so the cast can be fused into whatever writes q
  and k. The bound is loose (about 64 sigma): the largest real elements land a few binades below 448,
  which costs nothing in the normal range (e4m3's relative rounding is the same in every binade); only
  elements below ~sigma/2000 become subnormal, with an absolute error far below a typical element's.
  bf16 rounding can overshoot the bound by ulps; the cast saturates there.
- v: first shifted by its mean over the tokens m (per batch row and channel), since softmax rows sum to 1:
  P (v - m) + m = P v exactly. Then its amax (one reduction, `torch.linalg.vector_norm(inf)`; v = to_v(x)
  has no norm to bound it). Under SP both are taken after the exchange (this rank's heads, every token).
- the softmax P in [0, 1] (quantized inside the kernel for P @ V): 256; the output O' = P (v - m) is a convex
  combination of the shifted rows, so |O'| <= amax(v - m) and O' is written in e4m3 with that scale
  (Hopper's FP8 SDPA writes e4m3 only), then widened to bf16 with m added back in one elementwise pass.

Why the shift: e4m3 keeps 3 mantissa bits, so the output's own rounding costs about 2.5% of |O| whatever
the scale. Where v has a common component, that rounding lands on it and dominates the whole error: on the
19B block with synthetic weights the attention output is 99% v's mean over the tokens, and the output's
rounding was 2.6% of the call's 2.65% (`python -m bench.fp8_attn_error`); shifted, 0.07%. Trained weights
attend more sharply, so less of O is the mean; the shift never costs accuracy. It may also help the
accumulation of P (v - m) on Hopper's FP8 tensor cores, which keeps fewer bits than fp32 (an error that grows
with the keys summed; `bench.fp8_attn_block` measures both ways). Cost: one mean and one subtraction over v.

A masked call (SP padding a token count that does not divide by the world size, or a caller's mask) runs
the bf16 attention the callable replaced: cuDNN's FP8 SDPA takes no bias. So does, with the `auto` backend on
CUDA, a call over fewer than `FP8_ATTENTION_MIN_TOKENS` keys: there FP8 is slower (the amax and the casts cost
more than the kernel saves) as well as less exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "BACKENDS",
    "E4M3_MAX",
    "FP8_ATTENTION_MIN_TOKENS",
    "FP8_ATTENTION_MODULE_OPS_NAME",
    "P_SCALE",
    "Fp8SelfAttention",
    "attention_scales",
    "dequantize",
    "emulate_fp8_attention",
    "fp8_attention_count",
    "fp8_attention_support",
    "fp8_mm_attn_policy",
    "install_fp8_attention",
    "pow2_scales",
    "qk_bound",
    "quantize",
    "value_shift",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0  #: the softmax probabilities' scale in the kernel (P <= 1 -> <= 256, a power of two)
FP8_ATTENTION_MODULE_OPS_NAME = "fp8_video_self_attention"
BACKENDS = ("auto", "cudnn", "emulate", "sage")
#: Fewest keys a call needs for `auto` to take cuDNN's FP8 SDPA. Measured on one H200 (docs/performance.md,
#: "Attention backends"), the whole FP8 call against bf16 cuDNN: 0.453x at 1,536 tokens, 1.219x at 6,144, 1.527x
#: at 24,576; the speed-up is 1.0 about 0.71 of the way from 1,536 to 6,144 in log tokens (~4,100): below it,
#: bf16 attention is both faster and exact.
FP8_ATTENTION_MIN_TOKENS = 4096
_MANTISSA_1_75 = 0x600000  #: 448 = 1.75 * 2**8


# ---- scales ---------------------------------------------------------------------------------------------
def pow2_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) for fp32 `amax` (any shape): the smallest power of two with amax / scale <= 448,
    built from amax's bits (no division, no host sync; amax 0 gives 1). The same rule as `rowwise`'s."""
    amax = amax.to(torch.float32).contiguous()
    bits = amax.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > _MANTISSA_1_75).to(torch.int32)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-126, 126)
    return ((e + 127) << 23).view(torch.float32), ((127 - e) << 23).view(torch.float32)


def qk_bound(norm: nn.Module | None, inner_dim: int, device: torch.device) -> torch.Tensor:
    """Upper bound of |x| for x = RoPE(RMSNorm(y)) with `norm` over `inner_dim` features (module docstring):
    sqrt(inner_dim) * max|weight|, a 0-d fp32 tensor on `device` (no host sync)."""
    weight = getattr(norm, "weight", None)
    root = math.sqrt(int(inner_dim))
    if weight is None:
        return torch.full((), root, dtype=torch.float32, device=device)
    return weight.detach().abs().amax().to(device=device, dtype=torch.float32) * root


def attention_scales(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bound: torch.Tensor | None, k_bound: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, inverses), each (3,) fp32 for (q, k, v): q/k from their bounds (their amax where a bound is
    None: one reduction each), v from its amax."""

    def amax(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)

    qa = amax(q) if q_bound is None else q_bound.to(torch.float32)
    ka = amax(k) if k_bound is None else k_bound.to(torch.float32)
    return pow2_scales(torch.stack([qa.reshape(()), ka.reshape(()), amax(v)]))


def quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x * inv_scale)), `inv_scale` a one-element fp32 tensor (a power of two: exact). One Triton
    kernel on CUDA (a read of x, an e4m3 write), eager torch elsewhere: the same bits."""
    if x.is_cuda:
        from .triton_attn import quantize_triton, triton_available

        if triton_available():
            return quantize_triton(x, inv_scale)
    return (x.to(torch.float32) * inv_scale.reshape(())).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(
    x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """`x8 * scale` in `dtype` (one Triton kernel on CUDA); with `shift` (B, 1, C) for a (B, T, C) `x8`,
    `x8 * scale + shift` computed in fp32 and rounded once."""
    if x8.is_cuda:
        from .triton_attn import dequantize_triton, triton_available

        if triton_available():
            return dequantize_triton(x8, scale, dtype, shift)
    y = x8.to(torch.float32) * scale.reshape(())
    return (y if shift is None else y + shift.to(torch.float32)).to(dtype)


def value_shift(v: torch.Tensor) -> torch.Tensor:
    """v's mean over its tokens, (B, 1, C) in v's dtype: what the FP8 attention subtracts from v before the
    cast and adds back to the output (module docstring, "v")."""
    return v.mean(dim=1, keepdim=True, dtype=torch.float32).to(v.dtype)


# ---- the emulation (CPU, and the reference of the GPU tests) --------------------------------------------
def emulate_fp8_attention(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    scales: torch.Tensor,
    *,
    quantize_p: bool = True,
    quantize_o: bool = True,
    block: int = 1024,
) -> torch.Tensor:
    """Attention over e4m3 `q8`, `k8`, `v8` (B, H, T, D) with dequantization `scales` (3,), in fp32, with the
    kernel's other two roundings: the unnormalised softmax exp(s - rowmax) times `P_SCALE` cast to e4m3
    before P @ V (the row sum from the unrounded P), and the output cast to e4m3 on v's grid. Returns fp32
    (B, H, T, D) dequantized. Queries in blocks of `block` rows (memory B*H*block*T_k fp32)."""
    sq, sk, sv = (float(s) for s in scales.tolist())
    qf = q8.to(torch.float32) * sq
    kf = k8.to(torch.float32) * sk
    vf = v8.to(torch.float32) * sv
    c = 1.0 / math.sqrt(q8.shape[-1])
    out = torch.empty((*qf.shape[:-1], vf.shape[-1]), dtype=torch.float32, device=q8.device)
    for lo in range(0, qf.shape[-2], block):
        s = torch.matmul(qf[..., lo : lo + block, :], kf.transpose(-1, -2)) * c
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        rowsum = p.sum(dim=-1, keepdim=True)
        if quantize_p:
            p = (p * P_SCALE).to(E4M3).to(torch.float32) / P_SCALE
        o = torch.matmul(p, vf) / rowsum
        if quantize_o:
            o = (o / sv).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).to(torch.float32) * sv
        out[..., lo : lo + block, :] = o
    return out


# ---- the callable -----------------------------------------------------------------------------------------
def fp8_attention_support(device: torch.device, backend: str = "auto") -> str | None:
    """None when `backend` can run on `device`, else why not (setup turns it into an error)."""
    device = torch.device(device)
    if backend not in BACKENDS:
        return f"unknown FP8 attention backend {backend!r}; expected one of {BACKENDS}"
    if device.type != "cuda" or backend == "emulate":
        return None if backend in ("auto", "emulate") else f"the {backend} backend needs a CUDA device"
    if backend == "sage":
        from .sage_attention import sage_support

        return sage_support()
    from .cudnn_attention import cudnn_fp8_support

    return cudnn_fp8_support(device)


class Fp8SelfAttention:
    """ltx-core `AttentionCallable` for a video self-attention in FP8 (module docstring).

    Args:
        fallback: the attention it replaces (bf16), used for masked calls and calls `min_tokens` rules out.
        q_norm, k_norm: the attention's RMSNorms (their weights bound q and k); None: amax of q and k.
        backend: "auto" (cuDNN on CUDA, the emulation elsewhere), "cudnn", "emulate", or "sage" (SageAttention's
            INT8 Q.K^T with fp16 P.V: bf16 in, its own per-block scales, a comparison candidate).
        min_tokens: with `auto`, calls over fewer keys run `fallback`; None: `FP8_ATTENTION_MIN_TOKENS` where
            `auto` means cuDNN, 0 where it means the emulation (which exists for its numerics, not its speed).
            A named backend always runs FP8 (benchmarks and tests ask for it by name).
        smooth_v: subtract v's mean over the tokens before the cast and add it back after (module docstring);
            False only to measure what it saves.
    """

    def __init__(
        self,
        fallback: Callable[..., torch.Tensor],
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        backend: str = "auto",
        min_tokens: int | None = None,
        smooth_v: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown FP8 attention backend {backend!r}; expected one of {BACKENDS}")
        if min_tokens is not None and min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self.fallback = fallback
        self.q_norm, self.k_norm = q_norm, k_norm
        self.backend = backend
        self.min_tokens = min_tokens
        self.smooth_v = smooth_v

    def runs_fp8(self, keys: int, on_cuda: bool) -> bool:
        """Whether an unmasked call over `keys` keys takes the FP8 path (`min_tokens`)."""
        if self.backend != "auto":
            return True
        floor = self.min_tokens if self.min_tokens is not None else (FP8_ATTENTION_MIN_TOKENS if on_cuda else 0)
        return keys >= floor

    def _bound(self, norm: nn.Module | None, device: torch.device) -> torch.Tensor | None:
        if norm is None:
            return None
        return qk_bound(norm, int(norm.normalized_shape[0]), device)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if mask is not None or not self.runs_fp8(k.shape[1], q.is_cuda):
            return self.fallback(q, k, v, heads, mask)
        b, tq, hidden = q.shape
        d = hidden // heads
        backend = self.backend if self.backend != "auto" else ("cudnn" if q.is_cuda else "emulate")
        if backend == "sage":
            from .sage_attention import sage_attention

            return sage_attention(q, k, v, heads)
        shift = value_shift(v) if self.smooth_v else None
        if shift is not None:
            v = v - shift  # (bf16: a rounding of 2**-9, far under e4m3's; the same `shift` goes back below)
        scales, inv = attention_scales(q, k, v, self._bound(self.q_norm, q.device), self._bound(self.k_norm, q.device))
        q8, k8, v8 = (quantize(x, inv[i]) for i, x in enumerate((q, k, v)))
        if backend == "cudnn":
            from .cudnn_attention import cudnn_fp8_sdpa

            o8 = cudnn_fp8_sdpa(q8.view(b, tq, heads, d), k8.view(b, -1, heads, d), v8.view(b, -1, heads, d), scales)
            return dequantize(o8.view(b, tq, hidden), scales[2], q.dtype, shift)
        heads_first = [x.view(b, -1, heads, d).transpose(1, 2) for x in (q8, k8, v8)]
        out = emulate_fp8_attention(*heads_first, scales).transpose(1, 2).reshape(b, tq, hidden)
        return (out if shift is None else out + shift.to(torch.float32)).to(q.dtype)

    def __repr__(self) -> str:
        return (
            f"Fp8SelfAttention(backend={self.backend!r}, static_qk={self.q_norm is not None}, "
            f"min_tokens={self.min_tokens!r}, smooth_v={self.smooth_v})"
        )


def _wrap(fn: Any, attn: nn.Module, backend: str, smooth_v: bool = True) -> Any:
    """`fn` (an attention slot's value) with its bf16 attention replaced by `Fp8SelfAttention`; an SP
    wrapper (anything with an `inner`) keeps wrapping, the FP8 callable goes inside."""
    if isinstance(fn, Fp8SelfAttention):
        return fn
    inner = getattr(fn, "inner", None)
    if inner is not None and hasattr(fn, "manager"):
        if not isinstance(inner, Fp8SelfAttention):
            fn.inner = Fp8SelfAttention(inner, attn.q_norm, attn.k_norm, backend, smooth_v=smooth_v)
        return fn
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return Fp8SelfAttention(fn, *norms, backend, smooth_v=smooth_v)


def install_fp8_attention(
    model: nn.Module, *, backend: str = "auto", only_converted: bool = True, smooth_v: bool = True
) -> nn.Module:
    """Make every block's video self-attention (`attn1`) run in FP8, in place (before or after the SP patch).

    `only_converted`: skip the blocks fp8-mm's recipe keeps in bf16 (blocks 0 and 43-47 of the 19B model),
    so "fp8-mm+attn" leaves exactly those blocks unquantized."""
    from .recipe import excluded

    blocks = getattr(model, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"expected an LTXModel with transformer_blocks, got {type(model).__name__}")
    for i, block in enumerate(blocks):
        attn = getattr(block, "attn1", None)
        if attn is None or (only_converted and excluded(f"transformer_blocks.{i}.attn1.to_q")):
            continue
        attn.attention_function = _wrap(attn.attention_function, attn, backend, smooth_v)
        if hasattr(attn, "masked_attention_function"):  # newer ltx-core: the masked call keeps bf16 anyway
            attn.masked_attention_function = _wrap(attn.masked_attention_function, attn, backend, smooth_v)
    return model


def fp8_attention_count(model: nn.Module) -> int:
    """How many attentions of `model` call `Fp8SelfAttention` (directly or inside an SP wrapper)."""
    n = 0
    for module in model.modules():
        fn = getattr(module, "attention_function", None)
        n += isinstance(fn, Fp8SelfAttention) or isinstance(getattr(fn, "inner", None), Fp8SelfAttention)
    return n


def fp8_mm_attn_policy() -> Any:
    """The ltx-core `QuantizationPolicy` of `quantization="fp8-mm+attn"`: fp8-mm's, plus a module op that
    installs the FP8 video self-attention."""
    import ltx_core.loader  # noqa: F401
    from ltx_core.loader.module_ops import ModuleOps
    from ltx_core.model.transformer import LTXModel
    from ltx_core.quantization import QuantizationPolicy

    from .recipe import fp8_mm_policy

    base = fp8_mm_policy()
    op = ModuleOps(
        name=FP8_ATTENTION_MODULE_OPS_NAME, matcher=lambda m: isinstance(m, LTXModel), mutator=install_fp8_attention
    )
    return QuantizationPolicy(sd_ops=base.sd_ops, module_ops=(*base.module_ops, op))
