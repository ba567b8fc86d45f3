"""`SequenceParallelModelWrapper`: runs an LTX-2 transformer (whose attention was patched by
`SequenceParallelBuilder`) on this rank's slice of the video tokens and returns the full outputs.

Per forward, on every rank of the transformer group:
1. pad the video modality to a multiple of the world size (`partition.py`);
2. check the token budget: over `max_tokens` raises `ValueError` ("... Use a smaller resolution or fewer
   frames.") identically on every rank *before any collective*, so under the controller it becomes a
   recoverable `SymmetricRunnerError` and the fleet survives;
3. slice this rank's contiguous tokens and publish the per-rank counts to the all2all channels
   (`AttentionManager.set_rank_tokens`: runtime state, not an op argument);
4. run the model; the patched attentions exchange heads;
5. all-gather the video output tokens (rank order) and drop the padding;
6. broadcast rank 0's audio output (audio is computed replicated on every rank; the broadcast makes the
   ranks agree bit for bit even if replicated kernels were not deterministic).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import AttentionManager
from .collectives import all_gather_tokens, broadcast_tensor
from .partition import pad_modality_for_uniform_sharding, tile_modality_for_rank

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
    """Sequence-parallel forward around an SP-patched `LTXModel` (same call signature as the model)."""

    def __init__(self, model: torch.nn.Module, attention_manager: AttentionManager, *, sync_audio: bool = True) -> None:
        super().__init__()
        self.model = model
        self.attention_manager = attention_manager
        self.sync_audio = sync_audio

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
        padded, original_len = pad_modality_for_uniform_sharding(video, w)
        batch = padded.latent.shape[0]
        check_token_budget(padded.latent.shape[1], batch, mgr.max_tokens)  # before any collective
        if w == 1:
            return self.model(padded, audio, perturbations)
        tile, counts = tile_modality_for_rank(padded, rank, w)
        mgr.set_rank_tokens(counts, valid_tokens=original_len)
        vx, ax = self.model(tile, audio, perturbations)
        vx = all_gather_tokens(vx, mgr.group)[:, :original_len]
        if ax is not None and self.sync_audio:
            ax = broadcast_tensor(ax, 0, mgr.group)
        return vx, ax
