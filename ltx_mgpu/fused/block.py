"""ltx-core's `BasicAVTransformerBlock` and `Attention` with their elementwise work through `ops` (Triton on CUDA).

`fuse_elementwise(model)` swaps the class of every block and attention module of `model` for a subclass whose
forward computes what ltx-core's computes, in the same order and dtypes, with these replacements:

- the AdaLN-modulated RMS norms (`rms_norm(x) * (1 + scale) + shift`) and the plain ones: `ops.residual_norm`;
- each gated residual (`x + out * gate`, `x + out * gate * mask`, `x + out`), fused with the norm that reads
  its result next where there is one (self-attention -> text cross-attention's norm; audio-to-video ->
  feed-forward's modulated norm);
- each attention's q/k `RMSNorm` and split RoPE: `ops.norm_rope` (the interleaved RoPE stays eager).

Everything else is ltx-core's own modules, called as ltx-core calls them: the Linears (bf16 `nn.Linear` or
`Fp8Linear`, so LoRA fusion into their weights by the tracker applies unchanged, and an FP8 model keeps its
shared q/k/v quantization), the attention callable in `attention_function` (SP's all2all routing included),
the perturbation masks. Blocks with features this forward does not cover (text cross-attention AdaLN, gated
attention heads) run ltx-core's forward unchanged. Nothing syncs the host or depends on data, so the forward
captures into CUDA graphs as ltx-core's does. `unfuse_elementwise` restores the original classes.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from .ops import norm_rope, residual_norm

__all__ = ["fuse_elementwise", "fused_classes", "unfuse_elementwise"]


@functools.cache
def fused_classes() -> tuple[type, type]:
    """(fused block class, fused attention class), subclasses of ltx-core's (imported on first use)."""
    import ltx_core.loader  # noqa: F401  (ltx-core 1.0.0's import cycle: the loader first)
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig
    from ltx_core.guidance.perturbations import PerturbationType as P
    from ltx_core.model.transformer.attention import Attention
    from ltx_core.model.transformer.rope import LTXRopeType, apply_rotary_emb
    from ltx_core.model.transformer.transformer import BasicAVTransformerBlock

    class FusedAttention(Attention):
        """`Attention.forward` with the q/k norm and split RoPE in one kernel each."""

        def _qk(self, t: torch.Tensor, norm: torch.nn.RMSNorm, pe: Any) -> torch.Tensor:
            eps = norm.eps if norm.eps is not None else torch.finfo(t.dtype).eps
            if pe is not None and self.rope_type != LTXRopeType.SPLIT:
                return apply_rotary_emb(norm(t), pe, self.rope_type)
            cos, sin = (None, None) if pe is None else pe
            if norm.weight is None:
                return apply_rotary_emb(norm(t), pe, self.rope_type) if pe is not None else norm(t)
            return norm_rope(t, norm.weight, cos, sin, self.heads, eps=eps)

        def forward(
            self,
            x: torch.Tensor,
            context: torch.Tensor | None = None,
            mask: torch.Tensor | None = None,
            pe: Any = None,
            k_pe: Any = None,
            perturbation_mask: torch.Tensor | None = None,
            all_perturbed: bool = False,
        ) -> torch.Tensor:
            if self.to_gate_logits is not None:
                return super().forward(x, context, mask, pe, k_pe, perturbation_mask, all_perturbed)
            context = x if context is None else context
            v = self.to_v(context)
            if all_perturbed:
                return self.to_out(v)
            q = self._qk(self.to_q(x), self.q_norm, pe)
            k = self._qk(self.to_k(context), self.k_norm, pe if k_pe is None else k_pe)
            out = self.attention_function(q, k, v, self.heads, mask)
            if perturbation_mask is not None:
                out = out * perturbation_mask + v * (1 - perturbation_mask)
            return self.to_out(out)

    class FusedAVBlock(BasicAVTransformerBlock):
        """`BasicAVTransformerBlock.forward` with fused norms, modulation and gated residuals."""

        def _self_and_text(
            self, x: torch.Tensor, args: Any, table: torch.Tensor, attn1: Any, attn2: Any, perturbations: Any, skip: Any
        ) -> torch.Tensor:
            eps = self.norm_eps
            shift, scale, gate = self.get_ada_values(table, x.shape[0], args.timesteps, slice(0, 3))
            normed = residual_norm(x, scale=scale, shift=shift, eps=eps)[1]
            all_p = perturbations.all_in_batch(skip, self.idx)
            none_p = not perturbations.any_in_batch(skip, self.idx)
            pmask = perturbations.mask_like(skip, self.idx, x) if not all_p and not none_p else None
            out = attn1(
                normed,
                pe=args.positional_embeddings,
                mask=args.self_attention_mask,
                perturbation_mask=pmask,
                all_perturbed=all_p,
            )
            x, normed = residual_norm(x, out, gate, eps=eps)
            return residual_norm(x, attn2(normed, context=args.context, mask=args.context_mask), norm=False)[0]

        def _ff(self, x: torch.Tensor, args: Any, table: torch.Tensor, ff: Any, pending: tuple) -> torch.Tensor:
            """`x + ff(modulated norm) * gate`; `pending` (out, gate, mask) is a residual to add first (fused)."""
            shift, scale, gate = self.get_ada_values(table, x.shape[0], args.timesteps, slice(3, 6))
            x, normed = residual_norm(x, *pending, scale=scale, shift=shift, eps=self.norm_eps)
            return residual_norm(x, ff(normed), gate, norm=False)[0]

        def _av_values(self, table: torch.Tensor, args: Any, x: torch.Tensor, idx: slice) -> tuple:
            return self.get_av_ca_ada_values(
                table, x.shape[0], args.cross_scale_shift_timestep, args.cross_gate_timestep, idx
            )

        def forward(self, video: Any, audio: Any, perturbations: Any = None) -> tuple[Any, Any]:
            if self.cross_attention_adaln or video is None or audio is None:
                return super().forward(video, audio, perturbations)
            vx, ax = video.x, audio.x
            if perturbations is None:
                perturbations = BatchedPerturbationConfig.empty(vx.shape[0])
            run_vx, run_ax = video.enabled and vx.numel() > 0, audio.enabled and ax.numel() > 0
            run_a2v, run_v2a = run_vx and ax.numel() > 0, run_ax and vx.numel() > 0
            if run_vx:
                vx = self._self_and_text(
                    vx, video, self.scale_shift_table, self.attn1, self.attn2, perturbations, P.SKIP_VIDEO_SELF_ATTN
                )
            if run_ax:
                ax = self._self_and_text(
                    ax,
                    audio,
                    self.audio_scale_shift_table,
                    self.audio_attn1,
                    self.audio_attn2,
                    perturbations,
                    P.SKIP_AUDIO_SELF_ATTN,
                )
            v_pending: tuple = (None,)
            a_pending: tuple = (None,)
            vtab, atab = self.scale_shift_table_a2v_ca_video, self.scale_shift_table_a2v_ca_audio
            if run_a2v and not perturbations.all_in_batch(P.SKIP_A2V_CROSS_ATTN, self.idx):
                v_scale, v_shift, v_gate = self._av_values(vtab, video, vx, slice(0, 2))
                a_scale, a_shift, _ = self._av_values(atab, audio, ax, slice(0, 2))
                v_in = residual_norm(vx, scale=v_scale, shift=v_shift, eps=self.norm_eps)[1]
                a_in = residual_norm(ax, scale=a_scale, shift=a_shift, eps=self.norm_eps)[1]
                out = self.audio_to_video_attn(
                    v_in, context=a_in, pe=video.cross_positional_embeddings, k_pe=audio.cross_positional_embeddings
                )
                v_pending = (out, v_gate, perturbations.mask_like(P.SKIP_A2V_CROSS_ATTN, self.idx, vx))
            if run_v2a and not perturbations.all_in_batch(P.SKIP_V2A_CROSS_ATTN, self.idx):
                a_scale, a_shift, a_gate = self._av_values(atab, audio, ax, slice(2, 4))
                v_scale, v_shift, _ = self._av_values(vtab, video, vx, slice(2, 4))
                a_in = residual_norm(ax, scale=a_scale, shift=a_shift, eps=self.norm_eps)[1]
                v_in = residual_norm(vx, scale=v_scale, shift=v_shift, eps=self.norm_eps)[1]  # (x before a2v's)
                out = self.video_to_audio_attn(
                    a_in, context=v_in, pe=audio.cross_positional_embeddings, k_pe=video.cross_positional_embeddings
                )
                a_pending = (out, a_gate, perturbations.mask_like(P.SKIP_V2A_CROSS_ATTN, self.idx, ax))
            if run_vx:
                vx = self._ff(vx, video, self.scale_shift_table, self.ff, v_pending)
            elif v_pending[0] is not None:
                vx = residual_norm(vx, *v_pending, norm=False)[0]
            if run_ax:
                ax = self._ff(ax, audio, self.audio_scale_shift_table, self.audio_ff, a_pending)
            elif a_pending[0] is not None:
                ax = residual_norm(ax, *a_pending, norm=False)[0]
            return replace(video, x=vx), replace(audio, x=ax)

    return FusedAVBlock, FusedAttention


def fuse_elementwise(model: torch.nn.Module) -> int:
    """Switch every ltx-core block and attention module in `model` to the fused forwards (in place; weights,
    hooks and attention callables untouched); returns how many modules changed class."""
    block_cls, attn_cls = fused_classes()
    base_block, base_attn = block_cls.__mro__[1], attn_cls.__mro__[1]
    changed = 0
    for module in model.modules():
        if type(module) is base_block:
            module.__class__ = block_cls
            changed += 1
        elif type(module) is base_attn:
            module.__class__ = attn_cls
            changed += 1
    return changed


def unfuse_elementwise(model: torch.nn.Module) -> int:
    """Undo `fuse_elementwise`; returns how many modules changed class back."""
    block_cls, attn_cls = fused_classes()
    changed = 0
    for module in model.modules():
        if type(module) in (block_cls, attn_cls):
            module.__class__ = type(module).__mro__[1]
            changed += 1
    return changed
