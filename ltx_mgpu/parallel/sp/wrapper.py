"""`SequenceParallelModelWrapper`: runs an LTX-2 transformer (whose attention was patched by
`SequenceParallelBuilder`) on this rank's slice of the video tokens and returns the full outputs.

Per forward, on every rank of the transformer group (the group of the current layout when the wrapper
holds an `AttentionRouter`):
1. check the token budget: over `max_tokens` raises `ValueError` ("... Use a smaller resolution or fewer
   frames.") identically on every rank *before any collective*, so under the controller it becomes a
   recoverable `SymmetricRunnerError` and the fleet survives;
2. pad the video modality to a multiple of the world size and slice this rank's contiguous tokens
   (`sharding/partition.py`). The position-dependent part (padded positions, key mask, RoPE, attention bias) is
   the stage's *geometry*, computed once and reused while the same position tensor comes back
   (`graphs/hoist.py`); per step only the latent and timesteps are padded and sliced;
3. publish the per-rank counts to the all2all channels (`AttentionManager.set_rank_tokens`: runtime
   state, not an op argument);
4. run the model; the patched attentions exchange heads;
5. all-gather the video output tokens (rank order) and drop the padding;
6. broadcast rank 0's audio output (audio is computed replicated on every rank; the broadcast makes the
   ranks agree bit for bit even if replicated kernels were not deterministic).

Nothing here synchronises with the device or copies host memory to it (`tests/test_graph_ready.py`), so
the forward can be captured in a CUDA graph (`graphs/cuda_graph.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..graphs.hoist import ForwardHoister, ModalityGeometry, slice_tokens
from ..sharding.collectives import all_gather_tokens, broadcast_tensor
from ..sharding.partition import (
    OPTIONAL_TOKEN_FIELDS,
    pad_modality_for_uniform_sharding,
    padded_token_count,
    tile_modality_for_rank,
)
from .attention import AttentionManager

__all__ = ["SequenceParallelModelWrapper", "check_token_budget"]


def check_token_budget(total_tokens: int, batch: int, max_tokens: int) -> None:
    """Raise the SP budget `ValueError` when `batch * total_tokens` (padded) exceeds `max_tokens`.

    The batch counts because the exchange buffers hold batch x tokens rows; the reference ignores it and
    then fails fatally inside its kernel.
    """
    if batch * total_tokens > max_tokens:
        detail = f"{total_tokens}" if batch == 1 else f"{total_tokens} x batch {batch} = {batch * total_tokens}"
        raise ValueError(
            f"Total video token count ({detail}) exceeds attention_manager max_tokens ({max_tokens}). "
            "Use a smaller resolution or fewer frames."
        )


class SequenceParallelModelWrapper(torch.nn.Module):
    """Sequence-parallel forward around an SP-patched `LTXModel` (same call signature as the model).

    `attention_manager` is an `AttentionManager` or an `AttentionRouter` (whose active layout decides the
    group per forward). `hoist=False` keeps ltx-core's own per-forward preparation (for comparisons).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attention_manager: AttentionManager | Any,
        *,
        sync_audio: bool = True,
        hoist: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.attention_manager = attention_manager
        self.sync_audio = sync_audio
        self.hoister = ForwardHoister(model) if hoist else None

    @property
    def num_blocks(self) -> int:
        return len(self.model.transformer_blocks)

    def forward(
        self,
        video: Any | None,
        audio: Any | None,
        perturbations: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        mgr = self.attention_manager
        if video is None:  # audio-only: replicated on every rank, nothing to split
            return self.model(video, audio, perturbations)
        w, rank = mgr.world_size, mgr.rank
        total, batch = video.latent.shape[1], video.latent.shape[0]
        check_token_budget(padded_token_count(total, w), batch, mgr.max_tokens)  # before any collective
        if self.hoister is None:
            return self._forward_unhoisted(video, audio, perturbations)
        hoister = self.hoister
        vgeo = hoister.geometry("video", video, w, rank)
        tile = _tile(video, vgeo)
        ageo = hoister.geometry("audio", audio) if audio is not None else None
        perturbations = hoister.perturbations(perturbations)
        if w > 1:
            mgr.set_rank_tokens(vgeo.counts, valid_tokens=vgeo.original_len)
        with hoister.bind(video=vgeo, audio=ageo):
            vx, ax = self.model(tile, audio, perturbations)
        if w == 1:
            return vx, ax
        return self._gather(vx, ax, vgeo.original_len)

    def _forward_unhoisted(
        self, video: Any, audio: Any | None, perturbations: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        mgr = self.attention_manager
        w, rank = mgr.world_size, mgr.rank
        padded, original_len = pad_modality_for_uniform_sharding(video, w)
        if w == 1:
            return self.model(padded, audio, perturbations)
        tile, counts = tile_modality_for_rank(padded, rank, w)
        mgr.set_rank_tokens(counts, valid_tokens=original_len)
        vx, ax = self.model(tile, audio, perturbations)
        return self._gather(vx, ax, original_len)

    def _gather(
        self, vx: torch.Tensor, ax: torch.Tensor | None, original_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mgr = self.attention_manager
        vx = all_gather_tokens(vx, mgr.group)[:, :original_len]
        if ax is not None and self.sync_audio:
            ax = broadcast_tensor(ax, 0, mgr.group)
        return vx, ax


def _tile(video: Any, geo: ModalityGeometry) -> Any:
    """This step's video modality on this rank: per-token fields padded and sliced, positions and mask
    from the geometry (padded) or the step's own (sliced)."""
    pad = geo.padded_len - geo.original_len
    total = video.latent.shape[1]
    changes: dict[str, Any] = {
        "latent": slice_tokens(video.latent, pad, geo.start, geo.end),
        "positions": geo.positions(video),
        "attention_mask": geo.attention_mask(video),
    }
    for name in ("timesteps", *OPTIONAL_TOKEN_FIELDS):
        value = getattr(video, name, None)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == total:
            changes[name] = slice_tokens(value, pad, geo.start, geo.end)
    return dataclasses.replace(video, **changes)
