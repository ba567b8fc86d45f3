"""Pure host-side checks and shape arithmetic, shared by the IPC and loopback instances.

Everything here runs before any CUDA call, so a bad argument is a clear ValueError/TypeError on every
rank (the same on all of them when the arguments are symmetric) instead of an assertion in C++ or a
kernel indexing past its tables. Tested on CPU (tests/test_kernels_host.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MAX_RANKS = 8  # mirrors ltxk::kMaxRanks; the C++ side checks again

#: dtype -> element size; the kernel only moves bytes, so these four share one code path.
SUPPORTED_DTYPES: dict[torch.dtype, int] = {
    torch.bfloat16: 2,
    torch.float16: 2,
    torch.float32: 4,
    torch.float8_e4m3fn: 1,
}

OP_SEND_RECV, OP_GATHER, OP_ALL_GATHER = 0, 1, 2
OP_NAMES = ("send_recv_heads", "gather_heads", "all_gather_heads")


def check_world(world: int) -> None:
    if not 1 <= world <= MAX_RANKS:
        raise ValueError(
            f"the ipc all2all supports 1..{MAX_RANKS} ranks per instance, got world size {world}; "
            "use the dist backend for larger groups"
        )


def check_dtype(dtype: torch.dtype) -> int:
    """Returns the element size of a supported dtype."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"the ipc all2all supports {names}; got {dtype}")
    return SUPPORTED_DTYPES[dtype]


def check_timeout(timeout_s: float) -> float:
    t = float(timeout_s)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"all2all timeout must be a finite number of seconds > 0, got {timeout_s!r}")
    return t


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The CUDA device an instance lives on: the caller's (the rank's bound device), never the rank."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the ipc all2all needs a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def capacity_bytes(max_tokens_per_rank: int, hidden_dim: int, itemsize: int, max_batch: int) -> int:
    """Bytes of one rank's exchange buffer: the largest send_recv output (B * T * hidden/w) equals the
    largest local activation (B * max_tokens_per_rank * hidden), so one size covers every op."""
    for name, v in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden_dim", hidden_dim), ("max_batch", max_batch)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(max_batch) * int(max_tokens_per_rank) * int(hidden_dim) * itemsize


def check_counts(counts: Sequence[int], world: int) -> list[int]:
    out = [int(c) for c in counts]
    if len(out) != world:
        raise ValueError(f"set_rank_tokens expects {world} counts (one per rank), got {len(out)}")
    if any(c < 0 for c in out):
        raise ValueError(f"token counts must be >= 0, got {out}")
    return out


def check_input(x: torch.Tensor, op: int, *, dtype: torch.dtype, device: torch.device) -> None:
    name = OP_NAMES[op]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} expects a 4-D (B, S, H, D) tensor, got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name}: input dtype {x.dtype} differs from the instance dtype {dtype}")
    if x.device != device:
        raise ValueError(f"{name}: input is on {x.device} but the instance lives on {device}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: input must be contiguous (call .contiguous() first); strides {x.stride()}")


def output_shape(
    op: int, shape: Sequence[int], *, world: int, rank: int, counts: Sequence[int] | None
) -> tuple[int, int, int, int]:
    """Shape of `rank`'s output for an input of `shape` (raises like the C++ planner would)."""
    b, s, h, d = (int(v) for v in shape)
    name = OP_NAMES[op]
    if op == OP_ALL_GATHER:
        return (b, s, h * world, d)
    if counts is None:
        raise ValueError(f"{name}: call set_rank_tokens(counts) before exchanging")
    total = sum(counts)
    if op == OP_SEND_RECV:
        if h % world:
            raise ValueError(f"{name}: heads ({h}) must be divisible by world size ({world})")
        if s != counts[rank]:
            raise ValueError(f"{name}: rank {rank} input has {s} tokens but set_rank_tokens gave it {counts[rank]}")
        return (b, total, h // world, d)
    if s != total:
        raise ValueError(f"{name}: input has {s} tokens but the ranks' token counts add up to {total}")
    return (b, counts[rank], h * world, d)


def required_bytes(op: int, shape: Sequence[int], *, world: int, counts: Sequence[int] | None, itemsize: int) -> int:
    """Largest output any rank receives for this exchange (what every buffer must hold)."""
    b, s, h, d = (int(v) for v in shape)
    if op == OP_SEND_RECV:
        return b * sum(counts or []) * (h // world) * d * itemsize
    if op == OP_GATHER:
        return b * max(counts or [0]) * h * world * d * itemsize
    return b * s * h * world * d * itemsize


def check_capacity(
    op: int, shape: Sequence[int], *, world: int, counts: Sequence[int] | None, itemsize: int, capacity: int
) -> None:
    need = required_bytes(op, shape, world=world, counts=counts, itemsize=itemsize)
    if need > capacity:
        raise ValueError(
            f"{OP_NAMES[op]}: the output needs {need} bytes but the exchange buffer holds {capacity} bytes "
            f"(input shape {tuple(shape)}, world {world}); raise max_tokens_per_rank/max_batch or send fewer tokens"
        )
