"""Caches for the transformer forward that step aside under CUDA-graph capture (used by `hoist.py`).

Caches are keyed by the *identity* of the input tensors (memory address, shape, strides, dtype, device)
and watch their storage through a weak reference to its base tensor: when the caller drops it (the stage
or the job ends), the entry goes, so neither the address can be reused under a live entry nor the cache
keep a finished job's memory. Cached values never alias the inputs (they hold their own copies). Tensors
that track versions (everything made outside `torch.inference_mode`) must also still have the version
seen when the entry was made, so an in-place change invalidates it; inference tensors carry no version
counter and are never cached (computed every forward, still without syncs).

During a CUDA-graph capture (`capture_scope()`, or any stream capture) every cache is bypassed: the
graph computes positions, RoPE and masks from its own static input buffers into its own memory pool, so a
replay with new inputs (another job of the same shape, other positions) is correct, and nothing the graph
reads can be evicted from under it.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IdentityCache", "capture_scope", "capturing"]

_CAPTURE: contextvars.ContextVar[bool] = contextvars.ContextVar("ltx_mgpu_graph_capture", default=False)


@contextlib.contextmanager
def capture_scope() -> Iterator[None]:
    """Mark the code inside as running under CUDA-graph capture (caches bypassed). The graph wrapper enters
    it around every capture; CPU tests enter it to check the captured path."""
    token = _CAPTURE.set(True)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


def capturing() -> bool:
    """True inside `capture_scope()` or while the current CUDA stream is capturing."""
    if _CAPTURE.get():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# =========================================================================================================
# Identity cache
# =========================================================================================================


def _identity(t: torch.Tensor | None) -> Hashable:
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t._version)


@dataclass
class _Entry:
    roots: tuple[weakref.ref | None, ...]  #: the inputs' storage owners, watched, not kept alive
    versions: tuple[int | None, ...]
    value: Any


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `t`'s storage (views keep it alive; when it dies the memory may be reused)."""
    return t._base if t._base is not None else t


class IdentityCache:
    """Values computed from tensors, reused while the very same tensors come back unchanged (LRU; an entry
    leaves as soon as the storage of one of its inputs is freed)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, tensors: tuple[torch.Tensor | None, ...], extra: Hashable, compute: Callable[[], Any]) -> Any:
        if capturing() or any(t is not None and t.is_inference() for t in tensors):
            return compute()
        key = (tuple(_identity(t) for t in tensors), extra)
        versions = tuple(_version(t) for t in tensors)
        entry = self._entries.get(key)
        if entry is not None and entry.versions == versions and all(r is None or r() is not None for r in entry.roots):
            self._entries.move_to_end(key)
            self.hits += 1
            return entry.value
        self.misses += 1
        value = compute()
        entries = self._entries

        def forget(_: weakref.ref, key: Hashable = key) -> None:
            entries.pop(key, None)

        roots = tuple(None if t is None else weakref.ref(_root(t), forget) for t in tensors)
        self._entries[key] = _Entry(roots, versions, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
