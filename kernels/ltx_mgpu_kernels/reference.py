"""The three exchanges written in plain torch over all ranks' tensors at once: the definition the kernel
is tested against (and a readable statement of the layouts). Pure slicing and concatenation, so any dtype
works and results are bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["all_gather_heads", "gather_heads", "send_recv_heads"]


def send_recv_heads(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """xs[s]: (B, c[s], H, D) -> out[r]: (B, sum(c), H/w, D), rank r's head slice of every rank's tokens."""
    w = len(xs)
    hh = xs[0].shape[2] // w
    return [torch.cat([x[:, :, r * hh : (r + 1) * hh] for x in xs], dim=1) for r in range(w)]


def gather_heads(ys: Sequence[torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """ys[r]: (B, sum(c), H/w, D) -> out[t]: (B, c[t], H, D), head slot r taken from rank r."""
    offsets = [sum(counts[:t]) for t in range(len(counts))]
    return [torch.cat([y[:, offsets[t] : offsets[t] + counts[t]] for y in ys], dim=2) for t in range(len(counts))]


def all_gather_heads(zs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """zs[r]: (B, S, H/w, D) -> every rank gets (B, S, H, D) with rank r's slice in head slot r."""
    full = torch.cat(list(zs), dim=2)
    return [full.clone() for _ in zs]
