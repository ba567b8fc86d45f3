"""`HostSyncAudit`: find, without a GPU, every place a forward would involve the host on a GPU.

Method: run the model with its weights and inputs on the `meta` device (shapes only, no data) under a
`TorchDispatchMode` that sees every aten op. On a GPU these become host involvement, and they are exactly
what CUDA-graph capture forbids or silently bakes in:

- `host-copy`: an op moving a CPU tensor to the run's device (`_to_copy`, `copy_`). On a GPU: a
  host->device copy that synchronises the stream; a capture error.
- `cpu-op`: any other op with a CPU tensor argument or result. On a GPU: host work on every call, and a
  CPU value a graph would bake in.
- `host-sync`: `_local_scalar_dense` on a non-CPU tensor (`.item()`, `bool(t)`, `.tolist()`, `if t:`).
  On a GPU: a device->host sync; a capture error.
- `data-dependent`: `nonzero`, `masked_select`, `unique*`, boolean-mask indexing. On a GPU: an output
  shape that needs a sync; a capture error.

Meta tensors have no values, so the audit answers the host reads itself (a `_local_scalar_dense` returns
1 / True, `nonzero` assumes every element is non-zero) and the forward runs to the end, recording
every event in one pass. Each event names the op and the first source line outside torch and this
module. Per-call host work that dispatches no op at all (pure Python) is not seen; `count_ops` gives the
number of dispatched ops, so a hoisting change shows up as fewer ops per forward.

Collectives need a process group; `torch.distributed`'s "fake" backend (tests use it) completes them
without moving data, which lets one process audit any rank of an SP forward at any world size.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["HostEvent", "HostSyncAudit"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    """aten overloads by "name.overload" (ones this torch lacks are skipped)."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return frozenset(out)


_DATA_DEPENDENT = _ops(
    "nonzero.default",
    "masked_select.default",
    "_unique2.default",
    "unique_consecutive.default",
    "unique_dim.default",
    "repeat_interleave.Tensor",
)
_INDEXING = _ops("index.Tensor", "index_put_.default", "index_put.default", "_index_put_impl_.default")
_COPIES = _ops("_to_copy.default", "copy_.default")


@dataclass(frozen=True)
class HostEvent:
    """One op of the audited forward that involves the host on a GPU."""

    kind: str  #: "host-copy" | "cpu-op" | "host-sync" | "data-dependent"
    op: str  #: the aten overload, e.g. "aten._to_copy.default"
    where: str  #: "path/inside/site-packages.py:line" of the first frame outside torch and this module

    def __str__(self) -> str:
        return f"{self.kind:14s} {self.op:34s} {self.where}"


def _where() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path == _THIS_FILE:
            continue
        short = path.split("site-packages" + os.sep)[-1]
        return f"{short}:{frame.lineno}"
    return "?"


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else None
    if not isinstance(indices, list | tuple):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostSyncAudit(TorchDispatchMode):
    """Records `HostEvent`s while active (see the module docstring); `count_ops` counts every op."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[HostEvent] = []
        self.count_ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.count_ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is _aten._local_scalar_dense.default and tensors and tensors[0].device.type != "cpu":
            self.events.append(HostEvent("host-sync", str(func), _where()))
            dtype = tensors[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        kind = self._classify(func, args, tensors, outputs)
        if kind is not None:
            self.events.append(HostEvent(kind, str(func), _where()))
        return out

    @staticmethod
    def _classify(
        func: Any, args: tuple[Any, ...], inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> str | None:
        if func in _DATA_DEPENDENT or (func in _INDEXING and _bool_index(args)):
            return "data-dependent"
        if func is _aten._local_scalar_dense.default:
            return None  # a read of a CPU scalar (host state), not a device sync
        devices = [t.device.type == "cpu" for t in (*inputs, *outputs)]
        if not any(devices):
            return None
        if func in _COPIES and not all(devices):
            return "host-copy"
        return "cpu-op"

    # ---- reading the result ---------------------------------------------------------------------------
    def kinds(self) -> set[str]:
        return {e.kind for e in self.events}

    def report(self) -> str:
        """One line per distinct (kind, op, place), with a count."""
        counts: dict[HostEvent, int] = {}
        for event in self.events:
            counts[event] = counts.get(event, 0) + 1
        return "\n".join(f"{n:3d} x {event}" for event, n in counts.items())

    @contextlib.contextmanager
    def meta_data_dependent(self) -> Iterator[HostSyncAudit]:
        """Enter the audit with `nonzero` on meta tensors allowed (it assumes every element non-zero)."""
        import torch.fx.experimental._config as fx_config

        name = "meta_nonzero_assume_all_nonzero"  # absent in older torch: nonzero then raises on meta
        previous = getattr(fx_config, name, None)
        if previous is not None:
            setattr(fx_config, name, True)
        try:
            with self:
                yield self
        finally:
            if previous is not None:
                setattr(fx_config, name, previous)
