"""Small collectives of the SP data path that must work on every group/device combination we run:
NCCL with CUDA tensors, gloo with CPU tensors, and gloo with CUDA tensors (several ranks oversubscribed on
one GPU, where NCCL refuses to run): the last is staged through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_tokens", "broadcast_tensor", "collective_device", "needs_host_staging", "ordered_sum"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def needs_host_staging(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when `group` (gloo) cannot be trusted with tensors on `device` (a GPU)."""
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


def collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a small tensor for a collective on `group` must live: the rank's device for NCCL, the host
    for gloo."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, t, C) on every rank (same t everywhere: uniform sharding) -> (B, w*t, C), rank order."""
    w = dist.get_world_size(group)
    if w == 1:
        return x
    src = x.contiguous()
    staged = needs_host_staging(group, src.device)
    inp = src.cpu() if staged else src
    b, t, c = src.shape
    out = torch.empty((w * b, t, c), dtype=inp.dtype, device=inp.device)  # rank-major along dim 0
    _all_gather_single(out, inp, group=group)
    if staged:
        out = out.to(src.device)
    return out.view(w, b, t, c).permute(1, 0, 2, 3).reshape(b, w * t, c)


def broadcast_tensor(x: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Return rank `src`'s `x` (group rank) on every rank; shapes and dtypes must already agree."""
    if dist.get_world_size(group) == 1:
        return x
    buf = x.contiguous()
    staged = needs_host_staging(group, buf.device)
    tmp = buf.cpu() if staged else buf.clone()
    dist.broadcast(tmp, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return tmp.to(x.device) if staged else tmp


def ordered_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of every rank's `x` (same shape and dtype everywhere), added in rank order ((x0 + x1) + x2 ...)
    on every rank: the bits depend only on the inputs and the world size, never on the library's reduction
    algorithm (NCCL picks ring or tree by size and topology; a version or `NCCL_ALGO` can change it). One
    all-gather of `world` copies: what deterministic renders use in place of an all-reduce."""
    w = dist.get_world_size(group)
    if w == 1:
        return x
    src = x.contiguous().reshape(-1)
    staged = needs_host_staging(group, src.device)
    inp = src.cpu() if staged else src
    out = torch.empty((w * inp.numel(),), dtype=inp.dtype, device=inp.device)
    _all_gather_single(out, inp, group=group)
    parts = out.view(w, -1)
    total = parts[0].clone()
    for r in range(1, w):
        total += parts[r]
    total = total.view(x.shape)
    return total.to(x.device) if staged else total
