"""Sequence partitioning of the video modality: pad to a multiple of the world size, then give every rank
an equal contiguous slice. Pure functions (no process group), so they are tested on their own.

Why uniform slices: the all2all custom ops' fake implementations derive output shapes from the input
alone (S_total = S_local * world_size), which is what lets `torch.compile` trace them without knowing the
per-rank counts (those are runtime state).

Padding rules:
- no user attention mask: a key-only mask of shape (1, 1, T_padded) (float32, 1 = real key, 0 = padded
  key). O(T) memory; ltx-core turns it into a (1, 1, 1, T_padded) additive bias broadcast over batch,
  heads and queries.
- a user (B, T, T) mask in [0, 1]: placed top-left in a zero (B, T_padded, T_padded) matrix; padded
  *query* rows attend to every real key (an all-masked softmax row would be NaN; those rows are dropped
  after the forward anyway); padded key columns stay 0 for every query.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = [
    "OPTIONAL_TOKEN_FIELDS",
    "compute_sequence_offsets",
    "compute_sequence_partition",
    "pad_modality_for_uniform_sharding",
    "padded_token_count",
    "tile_modality_for_rank",
]

# Optional per-token fields some ltx-core versions carry on Modality (padded with zeros, sliced per rank).
OPTIONAL_TOKEN_FIELDS = ("keyframes_mask", "segment_ids")


def padded_token_count(total_tokens: int, world_size: int) -> int:
    """The smallest multiple of `world_size` that is >= `total_tokens`."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    return total_tokens + (-total_tokens) % world_size


def compute_sequence_partition(total_tokens: int, world_size: int) -> list[int]:
    """Per-rank token counts of a uniform split (pad first: non-divisible input is an error)."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if total_tokens % world_size:
        raise ValueError(
            f"compute_sequence_partition expects uniform sharding: total_tokens ({total_tokens}) must be "
            f"divisible by world_size ({world_size}). Pad the modality up-front."
        )
    return [total_tokens // world_size] * world_size


def compute_sequence_offsets(counts: list[int]) -> list[int]:
    """Exclusive prefix sum: where each rank's slice starts."""
    offsets, acc = [], 0
    for c in counts:
        offsets.append(acc)
        acc += int(c)
    return offsets


def _pad_dim(t: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_modality_for_uniform_sharding(modality: Any, world_size: int) -> tuple[Any, int]:
    """Pad a video `Modality` so its token count divides by `world_size`.

    Returns `(padded_modality, original_len)`; the modality is returned unchanged when already divisible.
    Appends zeros to the latent (dim 1), timesteps (dim 1), positions (dim 2 of (B, n, T, 2)) and any
    optional per-token field, and builds or extends the self-attention mask (module docstring).
    """
    latent = modality.latent
    total = latent.shape[1]
    pad = (-total) % world_size
    if pad == 0:
        return modality, total
    padded_total = total + pad
    changes: dict[str, Any] = {
        "latent": _pad_dim(latent, 1, pad),
        "positions": _pad_dim(modality.positions, 2, pad),
    }
    for name in ("timesteps", *OPTIONAL_TOKEN_FIELDS):
        value = getattr(modality, name, None)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == total:
            changes[name] = _pad_dim(value, 1, pad)  # per-token; a (B, 1) broadcast value stays as is

    mask = getattr(modality, "attention_mask", None)
    if mask is None:
        key_mask = torch.zeros((1, 1, padded_total), dtype=torch.float32, device=latent.device)
        key_mask[..., :total] = 1.0
        changes["attention_mask"] = key_mask
    else:
        if mask.dim() != 3 or mask.shape[-1] != total or mask.shape[-2] != total:
            raise ValueError(f"expected a (B, {total}, {total}) attention mask, got {tuple(mask.shape)}")
        full = mask.new_zeros((mask.shape[0], padded_total, padded_total))
        full[:, :total, :total] = mask
        full[:, total:, :total] = 1  # padded queries attend to every real key: no all-masked softmax row
        changes["attention_mask"] = full
    return dataclasses.replace(modality, **changes), total


def tile_modality_for_rank(modality: Any, rank: int, world_size: int) -> tuple[Any, list[int]]:
    """This rank's contiguous slice of a (padded) video `Modality`, and the per-rank counts.

    Only per-token fields are sliced (latent, timesteps, positions, optional per-token fields). The
    attention mask, context and sigma stay full-size: after the head exchange every rank attends over
    all tokens for its heads.
    """
    total = modality.latent.shape[1]
    counts = compute_sequence_partition(total, world_size)
    start = compute_sequence_offsets(counts)[rank]
    end = start + counts[rank]
    changes: dict[str, Any] = {
        "latent": modality.latent[:, start:end],
        "positions": modality.positions[:, :, start:end],
    }
    for name in ("timesteps", *OPTIONAL_TOKEN_FIELDS):
        value = getattr(modality, name, None)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == total:
            changes[name] = value[:, start:end]
    return dataclasses.replace(modality, **changes), counts
