"""What still holds a rank's device memory after a job ran out of it: one log line an operator can act on.

An out-of-memory job is released (`fleet._release_memory`: the job's frames collected, the allocator's cache
handed back) before the next one starts. Whatever is still allocated then is either the fleet's resident set or
something the job left behind, and the allocator's own message cannot tell them apart. This report can:

- by pool: the caching allocator's default pool against CUDA-graph private pools (`torch.cuda.memory_snapshot`
  names each segment's pool), so a graph that outlived its job shows up as a private pool;
- by tensor: the live device tensors the garbage collector can reach, grouped by (kind, dtype, shape) and
  ranked by bytes (each storage counted once), so a parameter set reads as many small groups and a leaked
  activation as one large one.

Both walks are slow (all Python objects, all segments): they run on the out-of-memory path only, never per job.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any

import torch

__all__ = ["live_memory_report", "pool_usage", "tensor_groups"]

GIB = float(1 << 30)


def pool_usage(snapshot: list[dict[str, Any]], device_index: int) -> dict[str, tuple[float, float]]:
    """{"default": (allocated, reserved), "graph pools": (allocated, reserved)} in bytes, from
    `torch.cuda.memory_snapshot()`'s segments of `device_index` (pool id (0, 0) is the default pool)."""
    out = {"default": [0.0, 0.0], "graph pools": [0.0, 0.0]}
    for seg in snapshot:
        if int(seg.get("device", device_index)) != device_index:
            continue
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        key = "default" if pool == (0, 0) else "graph pools"
        out[key][0] += float(seg.get("allocated_size", 0))
        out[key][1] += float(seg.get("total_size", 0))
    return {k: (v[0], v[1]) for k, v in out.items()}


def tensor_groups(device: torch.device, objects: list[Any] | None = None) -> list[tuple[str, int, float]]:
    """Live tensors on `device` among `objects` (default: every object the garbage collector tracks), as
    (group, count, bytes) sorted by bytes, largest first. A storage shared by several tensors (views, tied
    weights) is counted once, in the group of the first tensor seen on it."""
    device = torch.device(device)
    seen: set[tuple[int, int]] = set()
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for obj in gc.get_objects() if objects is None else objects:
        try:
            if not isinstance(obj, torch.Tensor) or obj.device != device:
                continue
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except Exception:  # tensors without storage (meta, sparse, fakes): nothing to count
            continue
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        kind = "parameter" if isinstance(obj, torch.nn.Parameter) else "tensor"
        group = f"{kind} {str(obj.dtype).removeprefix('torch.')} {tuple(obj.shape)}"
        groups[group][0] += 1
        groups[group][1] += key[1]
    return sorted(((g, int(c), float(b)) for g, (c, b) in groups.items()), key=lambda r: -r[2])


def live_memory_report(device: torch.device, top: int = 8) -> str:
    """One line: allocated and reserved on `device`, the split between the default pool and CUDA-graph pools,
    the parameters' total and the `top` largest non-parameter tensor groups."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device}: no device memory report off CUDA"
    index = device.index if device.index is not None else torch.cuda.current_device()
    allocated, reserved = torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index)
    pools = pool_usage(torch.cuda.memory_snapshot(), index)
    groups = tensor_groups(torch.device("cuda", index))
    params = sum(b for g, _, b in groups if g.startswith("parameter "))
    reached = sum(b for _, _, b in groups)
    others = [r for r in groups if not r[0].startswith("parameter ")][:top]
    split = ", ".join(f"{k} {a / GIB:.2f}/{r / GIB:.2f}" for k, (a, r) in pools.items())
    parts = [
        f"cuda:{index} allocated {allocated / GIB:.2f} GiB, reserved {reserved / GIB:.2f} GiB",
        f"pools (allocated/reserved GiB): {split}",
        f"reachable tensors {reached / GIB:.2f} GiB (parameters {params / GIB:.2f})",
        "largest other groups: " + ("; ".join(f"{g} x{c} {b / GIB:.2f} GiB" for g, c, b in others) or "none"),
    ]
    return " | ".join(parts)
