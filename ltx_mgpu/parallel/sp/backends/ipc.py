"""The `ipc` all2all backend: the CUDA-IPC kernel of `kernels/` (package `ltx_mgpu_kernels`) behind the
`All2AllBackend` interface of `ltx_mgpu.parallel.sp.all2all`.

This module always imports, with or without the compiled extension (CPU installs, CI): it registers the
factory under "ipc" and `is_available(device)` says whether the kernel can run here; `unavailable_reason()`
says why not. The factory raises a RuntimeError naming the reason when asked for an unusable backend.

Semantics are those of `ltx_mgpu_kernels.IpcAll2All` (docs/kernels.md): one IPC buffer per instance (per
tensor role), an entry handshake and an exit barrier inside every exchange, a barrier timeout that does not
poison the CUDA context but raises `All2AllTimeoutError` (naming the rank that never arrived) from the next
call or `synchronize()`. No dist barrier is needed after `set_rank_tokens`: token counts are host state of
each rank, and the kernel's entry handshake orders buffer reuse.

Outputs: a fresh tensor by default (copied out of the exchange buffer), so a direct caller may keep them
as long as it likes. `set_zero_copy(True)` (what `AttentionManager` does for its channels) returns views
of the exchange buffer instead, valid until the next exchange on the same instance (tensor role) is
enqueued. That is safe for the SP attention path, and it is what makes SP pay at small sizes (two H200s:
1.31-1.52x NCCL `all_to_all_single` with views against 0.98-1.14x with a copy-out):
- every output is consumed (attention reads q/k/v, `to_out` reads the gathered heads) before its role
  exchanges again, in stream order on this rank, and no output is fed back into its own instance;
- a peer writes into this rank's buffer only after this rank *entered* the next exchange on that role
  (the kernel's entry handshake), which stream order places after those consumers;
- under a CUDA graph the views are fixed addresses, like everything else the graph reads.
`tests/test_sp_parallel.py::test_sp_survives_outputs_overwritten_at_next_exchange` proves the first point
on CPU with a backend that poisons each role's previous output at its next exchange.
`LTX_MGPU_IPC_ZERO_COPY=0` keeps every output copied out, whatever `set_zero_copy` asks.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from ..all2all import register_backend

__all__ = ["IpcBackend", "create_ipc_backend", "is_available", "unavailable_reason"]

_KERNELS_MODULE = "ltx_mgpu_kernels"
DEFAULT_TIMEOUT_S = 10.0
ZERO_COPY_ENV = "LTX_MGPU_IPC_ZERO_COPY"  #: "0": always copy outputs out (set_zero_copy is ignored)


def _kernels() -> tuple[ModuleType | None, str | None]:
    try:
        mod = importlib.import_module(_KERNELS_MODULE)
    except ImportError as exc:
        return None, f"{_KERNELS_MODULE} is not installed ({exc}); build it with `pip install ./kernels`"
    if not mod.AVAILABLE:
        return None, f"{_KERNELS_MODULE} is installed without its compiled extension: {mod.IMPORT_ERROR}"
    return mod, None


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the ipc backend can run on `device`; otherwise a sentence saying why not."""
    mod, reason = _kernels()
    if mod is None:
        return reason
    if device is not None and torch.device(device).type != "cuda":
        return f"the ipc backend needs CUDA tensors, got device {device}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from ltx_mgpu_kernels._loader import extension

    if extension().device_count() < 1:
        return "the kernel extension sees no CUDA device (driver missing or too old)"
    if device is not None:
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        probe = getattr(extension(), "kernel_image_error", None)  # (a build from before the probe: not asked)
        image = probe(index) if probe is not None else None
        if image is not None:  # e.g. an sm_80 GPU (A100) and a build for sm_90 and later (kernels/CMakeLists.txt)
            major, minor = torch.cuda.get_device_capability(index)
            return f"the exchange kernel does not load on cuda:{index} (compute capability {major}.{minor}): {image}"
        # Peers may sit on any visible GPU: every other device must be reachable over P2P.
        for other in range(torch.cuda.device_count()):
            if other != index and not torch.cuda.can_device_access_peer(index, other):
                return f"cuda:{index} has no peer access to cuda:{other}"
    return None


def is_available(device: torch.device | None = None) -> bool:
    """True iff the compiled kernel loads and `device` (a CUDA device) can reach every other visible GPU."""
    return unavailable_reason(device) is None


class IpcBackend:
    """One exchange channel (one tensor role) on the CUDA-IPC kernel; see `all2all.py` for the contract."""

    requires_barrier_after_set_tokens = False  # the kernel's entry handshake orders everything

    def __init__(self, instance: Any, *, zero_copy: bool = False) -> None:
        self._inst = instance
        self._copy_out = True
        self.set_zero_copy(zero_copy)
        self.rank: int = instance.rank
        self.world_size: int = instance.world_size

    @property
    def instance(self) -> Any:
        """The underlying `ltx_mgpu_kernels.IpcAll2All` (for `synchronize()`, `check()`, buffer facts)."""
        return self._inst

    def set_rank_tokens(self, tokens: Sequence[int]) -> None:
        self._inst.set_rank_tokens(tokens)

    def set_timeout_seconds(self, seconds: float) -> None:
        self._inst.set_timeout(seconds)

    def set_zero_copy(self, enabled: bool) -> None:
        """Views of the exchange buffer instead of copies (see the module docstring for when that is safe)."""
        self._copy_out = not (enabled and os.environ.get(ZERO_COPY_ENV, "1") != "0")

    @property
    def zero_copy(self) -> bool:
        return not self._copy_out

    def send_recv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S_local, H, D) -> (B, S_total, H/w, D)."""
        return self._inst.send_recv_heads(x.contiguous(), copy_out=self._copy_out)

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S_total, H/w, D) -> (B, S_local, H, D)."""
        return self._inst.gather_heads(x.contiguous(), copy_out=self._copy_out)

    def all_gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H/w, D) -> (B, S, H, D)."""
        return self._inst.all_gather_heads(x.contiguous(), copy_out=self._copy_out)

    def synchronize(self) -> None:
        """Wait for this device's current stream and raise a recorded exchange failure, if any."""
        self._inst.synchronize()

    def destroy(self) -> None:
        self._inst.destroy()


def create_ipc_backend(
    *,
    group: Any,
    max_tokens_per_rank: int,
    hidden_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    timeout_s: float | None = None,
) -> IpcBackend:
    """Factory registered as "ipc" (collective over `group`: every rank, same order, same arguments)."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"all2all backend 'ipc' is unavailable: {reason}")
    mod, reason = _kernels()
    if mod is None:  # unreachable after unavailable_reason() is None; keeps the type checker honest
        raise RuntimeError(f"all2all backend 'ipc' is unavailable: {reason}")
    instance = mod.IpcAll2All(
        group,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden_dim=hidden_dim,
        dtype=dtype,
        device=device,
        timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
    )
    return IpcBackend(instance)


register_backend("ipc", create_ipc_backend)
