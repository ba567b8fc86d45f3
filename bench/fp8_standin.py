"""A synthetic stand-in for one LTX-2 `BasicAVTransformerBlock`'s video-token work, for `bench/fp8.py` on
hosts without ltx-core (the GPU hosts' bare image): the same Linear modules under the same names and call
pattern as ltx-core's (`attn1`, `attn2`, `audio_to_video_attn`, `video_to_audio_attn` with `to_q/to_k/to_v`
and `to_out[0]`; `ff.net` = GELU projection, identity, down projection), so `ltx_mgpu.fp8.convert_linears`
converts and wires it exactly as it does the real block, and the work between them: AdaLN-style modulated
RMS norms, q/k RMS norms, bf16 SDPA (flash on Hopper), gated residuals. Not modelled: RoPE (elementwise
on q and k) and the 126-token audio stream's own attention and feed-forward (under 1% of the FLOPs at
6,144 video tokens). Written for this bench from the block's published structure, not from its code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["StandInBlock"]


class GELUApprox(nn.Module):
    """The feed-forward's first stage: a Linear, then tanh-GELU (ltx-core's class of the same name)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(GELUApprox(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, query_dim: int, context_dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, inner) for d in (query_dim, context_dim, context_dim))
        self.q_norm, self.k_norm = nn.RMSNorm(inner, eps=1e-6), nn.RMSNorm(inner, eps=1e-6)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Identity())

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        v = self.to_v(context)
        q, k = self.q_norm(self.to_q(x)), self.k_norm(self.to_k(context))
        b, t, _ = q.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, z.shape[1], self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.to_out(out.transpose(1, 2).reshape(b, t, -1))


class StandInBlock(nn.Module):
    """Video tokens x (1, T, width) against text context (1, 128, width) and audio (1, 126, audio_width)."""

    def __init__(self, width: int, heads: int, audio_width: int, audio_heads: int) -> None:
        super().__init__()
        self.attn1 = Attention(width, width, heads, width // heads)
        self.attn2 = Attention(width, width, heads, width // heads)
        self.audio_to_video_attn = Attention(width, audio_width, audio_heads, audio_width // audio_heads)
        self.video_to_audio_attn = Attention(audio_width, width, audio_heads, audio_width // audio_heads)
        self.ff = FeedForward(width)
        self.table = nn.Parameter(torch.randn(9, width) / math.sqrt(width))  # shift/scale/gate per stage
        self.audio_table = nn.Parameter(torch.randn(3, audio_width) / math.sqrt(audio_width))

    def _mod(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=1e-6) * (1 + self.table[i]) + self.table[i + 1]

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.table[2] * self.attn1(self._mod(x, 0))
        x = x + self.attn2(F.rms_norm(x, (x.shape[-1],), eps=1e-6), ctx)
        x = x + self.table[5] * self.audio_to_video_attn(self._mod(x, 3), audio)
        a = F.rms_norm(audio, (audio.shape[-1],), eps=1e-6) * (1 + self.audio_table[0]) + self.audio_table[1]
        audio = audio + self.audio_table[2] * self.video_to_audio_attn(a, self._mod(x, 3))
        x = x + self.table[8] * self.ff(self._mod(x, 6))
        return x, audio
