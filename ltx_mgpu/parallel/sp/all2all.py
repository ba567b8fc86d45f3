"""The head-exchange interface of sequence parallelism: `All2AllBackend`, the backend registry, and the
`torch.library` custom ops every caller goes through.

Interface (stable; the `ipc` kernel backend in `backends/ipc.py` plugs in here without touching callers)
-----------------------------------------------------------------------------------------------------------
One backend *instance* exists per exchanged tensor role (q, k, v, heads). Instances are created
collectively (every rank of the group, same order, same arguments) by a factory registered under a name:

    register_backend(name, factory)
    factory(*, group, max_tokens_per_rank, hidden_dim, dtype, device, timeout_s) -> All2AllBackend

    group               torch.distributed ProcessGroup the exchange spans (group rank == position in it)
    max_tokens_per_rank ceil(max_tokens / world_size): capacity in tokens of one rank's local slice
    hidden_dim          num_heads * head_dim of the *video* stream (the largest exchanged row; the audio
                        cross-attention exchanges narrower rows through the same k/v instances)
    dtype               the activation dtype (the exchange only moves bytes, it never converts)
    device              the rank's own torch.device (from the caller, never derived from the rank number)
    timeout_s           barrier timeout in seconds (a device-side barrier's deadline; `dist` ignores it)

Instance methods (x is always contiguous-able; outputs are fresh or backend-owned tensors, never views of x):

    rank, world_size                      group rank and size
    set_rank_tokens(tokens)               per-rank local token counts for this forward (len == world_size);
                                          runtime state, never an op argument (so changing counts does not
                                          recompile); called on every rank before any exchange of a forward
    send_recv_heads(x)                    (B, S_local, H, D) -> (B, S_total, H/w, D); rank r receives heads
                                          [r*H/w, (r+1)*H/w) of every rank's tokens, concatenated in rank
                                          order (S_total = sum(tokens))
    gather_heads(x)                       (B, S_total, H/w, D) -> (B, S_local, H, D); exact inverse
    all_gather_heads(x)                   (B, S, H/w, D) -> (B, S, H, D); S is the same on every rank
                                          (audio path); rank r's input lands in heads [r*H/w, (r+1)*H/w)
    destroy()                             idempotent; frees resources

Optional instance attributes (looked up with getattr, absent means the default):

    set_timeout_seconds(s)                change the barrier timeout (validate first, then store)
    set_zero_copy(enabled)                return views of a backend-owned buffer, valid until the next call on
                                          the same instance, instead of fresh tensors; `AttentionManager`
                                          enables it for its channels (their callers consume every output
                                          before the role exchanges again)
    requires_barrier_after_set_tokens     bool, default False. True: `AttentionManager` runs one
                                          `dist.barrier(group)` after updating every role's token counts and
                                          before the first exchange of the forward (for kernels that read
                                          peers' token tables without an entry handshake)

Backend selection: `AttentionManager(backend="auto")` picks "ipc" on CUDA devices when the module
`ltx_mgpu.parallel.sp.backends.ipc` imports (it must call `register_backend("ipc", factory)` at import time)
and its module-level `is_available(device: torch.device) -> bool` returns True on every rank (the ranks
agree by an all-reduce, so one rank without peer access makes all ranks fall back); otherwise "dist".
Explicit names ("dist", "ipc", or anything registered) are used as given.

Custom ops (`torch.compile(fullgraph=True)` and CUDA graphs trace through them as opaque nodes):

    torch.ops.ltx_mgpu.send_recv_heads(x, comm_id: int, world_size: int) -> Tensor
    torch.ops.ltx_mgpu.gather_heads(x, comm_id: int, world_size: int) -> Tensor
    torch.ops.ltx_mgpu.all_gather_heads(x, comm_id: int, world_size: int) -> Tensor

`comm_id` names a live instance in a process-local table (`register_runtime`); `world_size` is a constant
of the op so the compile cache is keyed by it. The fake (meta) implementations derive shapes from the
input alone, assuming uniform sharding (S_total = S_local * world_size), which the SP wrapper guarantees
by padding. Uneven counts are supported by the backends in eager mode (byte-exact comparisons between
backends use them), not under `torch.compile`.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "IPC_MODULE",
    "All2AllBackend",
    "all_gather_heads",
    "available_backends",
    "gather_heads",
    "get_backend_factory",
    "get_runtime",
    "ipc_is_available",
    "register_backend",
    "register_runtime",
    "send_recv_heads",
    "unregister_runtime",
]

IPC_MODULE = "ltx_mgpu.parallel.sp.backends.ipc"  #: imported lazily; registers "ipc" on import
_BUILTIN_MODULES = {"dist": "ltx_mgpu.parallel.sp.backends.dist", "ipc": IPC_MODULE}


@runtime_checkable
class All2AllBackend(Protocol):
    """One head-exchange channel for one tensor role; see the module docstring for the full contract."""

    rank: int
    world_size: int

    def set_rank_tokens(self, tokens: Sequence[int]) -> None: ...

    def send_recv_heads(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_heads(self, x: torch.Tensor) -> torch.Tensor: ...

    def destroy(self) -> None: ...


BackendFactory = Callable[..., All2AllBackend]

# =========================================================================================================
# Backend registry (name -> factory)
# =========================================================================================================

_BACKENDS: dict[str, BackendFactory] = {}
_LOCK = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register (or replace) the factory for a backend name. Built-in modules call this on import."""
    if not name or not callable(factory):
        raise ValueError(f"register_backend needs a name and a callable factory, got {name!r}, {factory!r}")
    with _LOCK:
        _BACKENDS[name] = factory


def get_backend_factory(name: str) -> BackendFactory:
    """The factory for `name`, importing a built-in backend module on first use (lazy: the kernel module
    is only imported when asked for, so CPU installs never touch it)."""
    with _LOCK:
        factory = _BACKENDS.get(name)
    if factory is None and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])  # registers itself
        with _LOCK:
            factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"Unknown all2all backend {name!r}; registered: {sorted(available_backends())}")
    return factory


def available_backends() -> list[str]:
    """Names registered so far in this process (built-ins appear once imported)."""
    with _LOCK:
        return sorted(_BACKENDS)


def ipc_is_available(device: torch.device) -> bool:
    """True iff the `ipc` kernel backend imports and reports itself usable on `device` (this rank only;
    `AttentionManager` makes the ranks agree)."""
    if device.type != "cuda":
        return False
    try:
        module = importlib.import_module(IPC_MODULE)
    except Exception:  # ImportError, or an extension that fails to load (missing driver, wrong arch)
        return False
    probe = getattr(module, "is_available", None)
    if probe is None:
        return "ipc" in available_backends()
    try:
        return bool(probe(device))
    except TypeError:  # a probe that takes no device
        return bool(probe())
    except Exception:
        return False


# =========================================================================================================
# Runtime table: comm_id -> live instance (what the custom ops dispatch to)
# =========================================================================================================

_RUNTIMES: dict[int, All2AllBackend] = {}
_NEXT_COMM_ID = [0]


def register_runtime(backend: All2AllBackend) -> int:
    """Give a live instance a process-local id the custom ops can carry as a constant int."""
    with _LOCK:
        comm_id = _NEXT_COMM_ID[0]
        _NEXT_COMM_ID[0] += 1
        _RUNTIMES[comm_id] = backend
    return comm_id


def unregister_runtime(comm_id: int) -> None:
    with _LOCK:
        _RUNTIMES.pop(comm_id, None)


def get_runtime(comm_id: int) -> All2AllBackend:
    with _LOCK:
        backend = _RUNTIMES.get(comm_id)
    if backend is None:
        raise RuntimeError(f"all2all runtime {comm_id} is not registered (destroyed AttentionManager?)")
    return backend


def _check_world(backend: All2AllBackend, world_size: int) -> None:
    if backend.world_size != world_size:
        raise RuntimeError(f"all2all op traced for world_size {world_size} but the runtime has {backend.world_size}")


# =========================================================================================================
# Custom ops. No device_types restriction: the same op runs over gloo on CPU and NCCL/IPC on CUDA.
# =========================================================================================================


@torch.library.custom_op("ltx_mgpu::send_recv_heads", mutates_args=())
def _send_recv_heads_op(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    backend = get_runtime(comm_id)
    _check_world(backend, world_size)
    return backend.send_recv_heads(x)


@_send_recv_heads_op.register_fake
def _(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.new_empty((b, s * world_size, h // world_size, d))


@torch.library.custom_op("ltx_mgpu::gather_heads", mutates_args=())
def _gather_heads_op(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    backend = get_runtime(comm_id)
    _check_world(backend, world_size)
    return backend.gather_heads(x)


@_gather_heads_op.register_fake
def _(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.new_empty((b, s // world_size, h * world_size, d))


@torch.library.custom_op("ltx_mgpu::all_gather_heads", mutates_args=())
def _all_gather_heads_op(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    backend = get_runtime(comm_id)
    _check_world(backend, world_size)
    return backend.all_gather_heads(x)


@_all_gather_heads_op.register_fake
def _(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.new_empty((b, s, h * world_size, d))


def send_recv_heads(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    """(B, S_local, H, D) -> (B, S_total, H/w, D) through the registered runtime `comm_id`."""
    return torch.ops.ltx_mgpu.send_recv_heads(x, comm_id, world_size)


def gather_heads(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    """(B, S_total, H/w, D) -> (B, S_local, H, D): the inverse of `send_recv_heads`."""
    return torch.ops.ltx_mgpu.gather_heads(x, comm_id, world_size)


def all_gather_heads(x: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
    """(B, S, H/w, D) -> (B, S, H, D): every rank's head slice, in rank order."""
    return torch.ops.ltx_mgpu.all_gather_heads(x, comm_id, world_size)
