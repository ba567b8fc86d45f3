"""`Fp8Linear`: a drop-in for `nn.Linear` whose GEMM runs in FP8 e4m3 (per-token activation scales,
per-output-channel weight scales, bf16 output), and the pieces that make the activation quantization cheap.

The GEMM: `torch._scaled_mm` with rowwise scales on GPUs with FP8 tensor cores (compute capability >= 8.9,
i.e. Hopper/Ada and later) when the shapes suit it (K and N multiples of 16). Everywhere else (CPU, older
GPUs, odd tiny shapes) an emulation: dequantize both operands in fp32 (an activation exactly: an e4m3
value times a power of two; a weight with one fp32 rounding of e4m3 times its channel scale, where the GPU
applies that scale after the sum instead), then an fp32 matmul. The quantization itself is identical in
both (`rowwise`), so the CPU numerics tests measure the roundings the GPU does; only where the weight scale
is applied and the summation order differ (fp32-sized effects, far below e4m3's 2**-4).

Why `torch._scaled_mm` and not torchao: torchao is not installed on the GPU hosts or here, and its float8
inference path is a wrapper over the same `torch._scaled_mm` call plus a tensor subclass that CUDA-graph
capture and our in-place LoRA swaps (which rewrite `weight` and `weight_scale` by address) would have to see
through. Calling the op directly keeps weights as plain parameters.

Making the activation quantization pay off (measured on an H200: an eager amax/scale/cast per linear cost
more than the FP8 GEMMs saved, 0.57-0.75x of bf16):
- one fused kernel per quantization (`rowwise.quantize_rows`: read bf16 once, write fp8 once);
- an attention's q/k/v (and its gate) projections read the same input: they share one quantization through
  `SharedInput` (two entries, so a cross-attention's context and query are each quantized once); the output
  projection closes the attention and drops the entries;
- the feed-forward's GELU is fused into the quantization of the down projection's input (`Fp8GeluProj`
  returns `Fp8Rows`, which `Fp8Linear` consumes as is): the 4x-wide hidden activation is never written in bf16.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .rowwise import E4M3, quantize_rows, quantize_weight

__all__ = [
    "Fp8GeluProj",
    "Fp8Linear",
    "Fp8Rows",
    "SharedInput",
    "emulated_gemm",
    "fp8_gemm",
    "fp8_tensor_cores",
    "scaled_mm_rowwise",
]


@dataclass(frozen=True)
class Fp8Rows:
    """A quantized activation: q (M, K) e4m3, scale (M, 1) fp32, and the leading shape to restore."""

    q: torch.Tensor
    scale: torch.Tensor
    lead: tuple[int, ...]
    dtype: torch.dtype  #: the dtype the unquantized activation had (the GEMM's output dtype)


@functools.cache
def fp8_tensor_cores(device: torch.device) -> bool:
    """The device has FP8 tensor cores that `torch._scaled_mm` drives (sm_89 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _bias_in_gemm(device: torch.device) -> bool:
    """Whether this build's rowwise `_scaled_mm` takes a bf16 bias (probed once per device, on a tiny GEMM)."""
    a = torch.zeros((16, 16), dtype=E4M3, device=device)
    b = torch.zeros((16, 16), dtype=E4M3, device=device)
    ones = torch.ones((16, 1), dtype=torch.float32, device=device)
    try:
        bias = torch.zeros(16, dtype=torch.bfloat16, device=device)
        torch._scaled_mm(a, b.t(), scale_a=ones, scale_b=ones.t(), bias=bias, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # whatever this build says "no" with
        return False
    return True


def fp8_gemm(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(q * scale) @ (weight * weight_scale[:, None]).T + bias, in `out_dtype`; q (M, K), weight (N, K)."""
    n, k = weight.shape
    if fp8_tensor_cores(q.device) and k % 16 == 0 and n % 16 == 0 and out_dtype == torch.bfloat16:
        in_gemm = bias is not None and bias.dtype == out_dtype and _bias_in_gemm(q.device)
        out = scaled_mm_rowwise(q, scale, weight, weight_scale, bias if in_gemm else None, out_dtype)
        return out if bias is None or in_gemm else out + bias.to(out_dtype)
    return emulated_gemm(q, scale, weight, weight_scale, bias, out_dtype)


def emulated_gemm(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_gemm` without FP8 tensor cores: dequantize in fp32 (see the module docstring), one fp32 matmul."""
    out = (q.float() * scale) @ (weight.float() * weight_scale.view(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm_rowwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The `torch._scaled_mm` call itself: q (M, K) row-major, the (N, K) weight passed transposed (so
    column-major, as the op wants), scales (M, 1) and (1, N) in fp32. CPU builds of torch implement it too,
    which lets the CPU tests check this call's semantics against the emulation."""
    n = weight.shape[0]
    return torch._scaled_mm(
        q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, n), bias=bias, out_dtype=out_dtype
    )


class SharedInput:
    """The last two quantized inputs of one attention module, so its projections quantize each input once.

    An entry matches only the very tensor it was made from (held by weak reference) at the same in-place
    version: a freed or modified tensor never hits. Inference-mode tensors keep no version counter; there
    the entries' lifetime is the guard: they live from an attention's first input projection to its output
    projection, and ltx-core's `Attention.forward` modifies neither input in between. Under CUDA-graph
    capture the lookups run once, at capture, and the replay repeats exactly the kernels they chose."""

    def __init__(self) -> None:
        self._entries: list[tuple[weakref.ref, int, Fp8Rows]] = []

    def get(self, x: torch.Tensor) -> Fp8Rows | None:
        for ref, version, rows in self._entries:
            if ref() is x and _version(x) == version:
                return rows
        return None

    def put(self, x: torch.Tensor, rows: Fp8Rows) -> None:
        self._entries = [*self._entries[-1:], (weakref.ref(x), _version(x), rows)]

    def clear(self) -> None:
        self._entries = []


def _version(x: torch.Tensor) -> int:
    return -1 if x.is_inference() else x._version


def _quantize(x: torch.Tensor) -> Fp8Rows:
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return Fp8Rows(q, scale, tuple(x.shape[:-1]), x.dtype)


class Fp8Linear(nn.Module):
    """`nn.Linear` with an e4m3 weight (N, K) and fp32 per-output-channel `weight_scale` (N,); bias stays
    in its own dtype (bf16). Takes a tensor (quantized here, or found in `share`) or an `Fp8Rows`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = nn.Parameter(
            torch.empty((out_features, in_features), dtype=E4M3, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=torch.bfloat16, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)
        self.share: SharedInput | None = None  #: set for an attention's input projections
        self.closes_share = False  #: the output projection: the attention's inputs are done with

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """An empty (meta or uninitialised) Fp8Linear of `linear`'s shape on its device."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device)

    @torch.no_grad()
    def load_from(self, linear: nn.Linear) -> Fp8Linear:
        """Quantize `linear`'s weight into this module (per output channel) and take its bias."""
        q, scale = quantize_weight(linear.weight)
        self.weight.data, self.weight_scale.data = q, scale
        if linear.bias is not None:
            self.bias.data = linear.bias.detach().to(torch.bfloat16)
        return self

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # The published fp8 checkpoints carry one scale per tensor (a 0-d `weight_scale`): one per channel here.
        key = prefix + "weight_scale"
        scale = state_dict.get(key)
        if scale is not None and scale.dim() == 0:
            state_dict[key] = scale.float().expand(self.out_features).contiguous()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        share = self.share
        if self.closes_share and share is not None:
            # The output projection ends the attention: its entries go, and its own input (the attention's
            # output, read by nothing else) never enters the share: an entry left there would outlive the
            # forward, one per attention of every block, 27 GiB at 63,240 tokens on the 19B model.
            share.clear()
            share = None
        if isinstance(x, Fp8Rows):
            rows = x
        else:
            rows = share.get(x) if share is not None else None
            if rows is None:
                rows = _quantize(x)
                if share is not None:
                    share.put(x, rows)
        out = fp8_gemm(rows.q, rows.scale, self.weight, self.weight_scale, self.bias, rows.dtype)
        return out.view(*rows.lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 rowwise"


class Fp8GeluProj(nn.Module):
    """ltx-core's `GELUApprox` (a Linear, then tanh-GELU) whose output is the down projection's quantized
    input: GELU and quantization in one kernel. The `proj` submodule keeps the checkpoint's key names."""

    def __init__(self, proj: Fp8Linear) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> Fp8Rows:
        h = self.proj(x)
        q, scale = quantize_rows(h.reshape(-1, h.shape[-1]), gelu=True)
        return Fp8Rows(q, scale, tuple(h.shape[:-1]), h.dtype)
