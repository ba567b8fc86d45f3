"""Weights that live in pinned host memory and visit the GPU: the memory plan's host tiers
(`ltx_mgpu.spec.placement`, docs/memory.md "Placement").

- `pinned_buffer(nbytes, device)`: page-locked host bytes, exactly `nbytes` (registered with the CUDA driver:
  torch's pinned allocator rounds every block up to a power of two, which would nearly double a 35 GiB copy),
  so copies to the device run at the link's full rate and need not block the host. A plain host buffer on CPU
  ranks, or where the driver refuses to lock that much (copies then run synchronously, and a warning says so).
  The registration ends when the last tensor viewing the bytes is gone, before the bytes are freed: one that
  outlived them would make the driver treat whatever is allocated there next as page-locked, and copies from it
  fail ("invalid argument", "already mapped": seen on an H100 before this was done).
- `pack_pinned(tensors, device)`: tensors packed into one such buffer, returned as views of it.
- `StreamedLayers`: a layer stack kept in pinned host memory, each layer copied in one layer ahead of its use
  and dropped after it (the text encoder's `stream` tier).
- `compute_on_host`: a submodule that stays in host memory and runs there, its inputs brought to the host and
  its outputs sent to the device (what the `stream` tier keeps off the card: a gather, or never-run parts).
- `ParkableWeights`: a module whose parameters can leave the GPU between uses. Its pinned mirror is made once
  (the weights never change), so `park()` only drops the GPU copy (no device-to-host copy) and `unpark()` copies
  the mirror back into a few allocations of at most `PIECE_BYTES` each (whole parameters; one larger parameter
  gets a piece of its own), laid out as the mirror is. Pieces, not one block: Gemma's 24.6 GiB in one piece
  needs that much contiguous free memory, which a card that has it in total but fragmented (CUDA-graph pools,
  a decode's leftovers) cannot give; 1 GiB pieces cost nothing measurable in copy time (each copy still runs at
  the link's rate). The copies run on a side stream; the stream that uses the module next waits for them
  (`ensure()`), so a caller can start them as early as the room exists and pay only where nothing hides them.

On CPU ranks the same calls run (the "GPU copy" is a second host tensor), so the CPU test suite covers the
bookkeeping; the speed only shows on a GPU (`bench.host_link`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "ParkableWeights",
    "StreamedLayers",
    "compute_on_host",
    "largest_layer_list",
    "pack_pinned",
    "pinned_buffer",
    "stream_module",
]

log = logging.getLogger("ltx_mgpu.runners.host_tier")

_ALIGN = 256  #: byte alignment of every parameter in the mirror and in the device buffer
PIECE_BYTES = 1 << 30  #: the largest device allocation `ParkableWeights.unpark` makes (unless one parameter is larger)


def _pin_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class _RegisteredBytes(np.ndarray):
    """Host bytes registered with the CUDA driver, unregistered when this array is collected.

    Why a numpy array and not a torch tensor: `torch.from_numpy` keeps the array alive for as long as any tensor
    viewing its storage lives, and the array's `__del__` runs before its base frees the bytes, so the
    registration ends exactly between the last use and the free. A torch tensor offers no such hook (a finalizer
    on the first tensor would run while views of it still copy from the bytes)."""

    _registered: int = 0  #: the registered address (0: none; numpy views of this array never own one)

    def __del__(self) -> None:
        if self._registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered)
            except Exception:  # (at interpreter exit the runtime may be gone: nothing left to release then)
                pass


def _status(err: Any) -> int:
    return int(getattr(err, "value", err))


def pinned_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` host bytes (uint8), page-locked for copies to `device` when it is a CUDA device, for as long as
    any tensor viewing them lives."""
    if not _pin_ok(torch.device(device)):
        return torch.empty(max(1, int(nbytes)), dtype=torch.uint8)
    array = np.empty(max(1, int(nbytes)), dtype=np.uint8).view(_RegisteredBytes)
    address = int(array.ctypes.data)
    err = torch.cuda.cudart().cudaHostRegister(address, array.size, 0)
    if _status(err) == 0:
        array._registered = address
    else:  # (RLIMIT_MEMLOCK, a driver limit): slower copies, still correct
        log.warning(
            "could not page-lock %.1f GiB of host memory (%s): copies to the GPU will be synchronous",
            nbytes / 2**30,
            err,
        )
    return torch.from_numpy(array)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pieces(layout: Sequence[tuple[int, int]], total: int, limit: int) -> list[tuple[int, int]]:
    """Mirror byte ranges [start, end) that split `layout` (offset, bytes per parameter, in order) between
    parameters, each at most `limit` bytes unless a single parameter is larger."""
    pieces: list[tuple[int, int]] = []
    begin = 0
    for start, size in layout:
        if start > begin and start + _aligned(size) - begin > limit:
            pieces.append((begin, start))
            begin = start
    pieces.append((begin, total))
    return pieces


def pack_pinned(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host copies of `tensors` as views of one `pinned_buffer` (each at a 256-byte boundary)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    buffer = pinned_buffer(total, device)
    out = []
    for t, start in zip(tensors, offsets, strict=True):
        view = buffer[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


class ParkableWeights:
    """`module`'s parameters (each once, tied ones shared) with a pinned host mirror; see the module docstring.

    Buffers stay where they are (rotary tables, scales: small). Not thread-safe; one rank's own module.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.module = module
        self.device = torch.device(device)
        # Each weight once: a Parameter met again (tied) or a second Parameter over the same memory (a load that
        # filed one tensor under two keys, as ltx-core does Gemma's token table and head) follows its owner, so a
        # park mirrors it once and an unpark does not bring it back as two device copies.
        self._params: list[torch.nn.Parameter] = []
        self._aliases: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (alias, owner)
        owners: dict[tuple[Any, ...], torch.nn.Parameter] = {}
        for p in module.parameters():  # (each Parameter object once)
            where = (p.device, p.data_ptr(), p.dtype, tuple(p.shape), p.stride())
            if p.numel() and where in owners:
                self._aliases.append((p, owners[where]))
                continue
            owners[where] = p
            self._params.append(p)
        self._layout: list[tuple[int, int]] = []  # (byte offset, bytes) per parameter
        offset = 0
        for p in self._params:
            self._layout.append((offset, p.numel() * p.element_size()))
            offset += _aligned(p.numel() * p.element_size())
        self.nbytes = offset
        self._pieces = _pieces(self._layout, offset, PIECE_BYTES)
        self._mirror = pinned_buffer(offset, self.device)
        for p, (start, size) in zip(self._params, self._layout, strict=True):
            self._mirror[start : start + size].copy_(p.detach().reshape(-1).view(torch.uint8))
        self.parked = False
        self._ready: torch.cuda.Event | None = None
        self._stream = stream  #: the copy-back stream (None: one of its own, made at the first copy back)
        self.stats = {"parks": 0, "unparks": 0}

    def _views(self, buffers: Sequence[torch.Tensor], bases: Sequence[int] = (0,)) -> list[torch.Tensor]:
        """Each parameter's view of whichever buffer holds it (`buffers[i]` starts at mirror byte `bases[i]`)."""
        views, piece = [], 0
        for p, (start, size) in zip(self._params, self._layout, strict=True):
            while piece + 1 < len(bases) and start >= bases[piece + 1]:
                piece += 1
            begin = start - bases[piece]
            views.append(buffers[piece][begin : begin + size].view(p.dtype).view(p.shape))
        return views

    def park(self) -> None:
        """Drop the GPU copy: the parameters point at the pinned mirror until `unpark()`. Idempotent."""
        if self.parked:
            return
        self.ensure()  # (a copy still in flight targets the memory being dropped)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the last use of the GPU copy has finished
        self._point(self._views([self._mirror]))
        self.parked = True
        self.stats["parks"] += 1

    def unpark(self) -> None:
        """Copy the mirror back to the GPU, piece by piece (a side stream on CUDA; `ensure()` orders the next use
        after it). Idempotent. Out of memory part-way: the pieces already allocated are dropped, the weights stay
        parked and the error is raised, so a caller may retry once there is room."""
        if not self.parked:
            return
        buffers = [torch.empty(end - start, dtype=torch.uint8, device=self.device) for start, end in self._pieces]
        bases = [start for start, _ in self._pieces]
        if self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # (the buffers' memory is free there)
            with torch.cuda.stream(self._stream):
                for buffer, (start, end) in zip(buffers, self._pieces, strict=True):
                    buffer.copy_(self._mirror[start:end], non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(self._stream)
            for buffer in buffers:
                buffer.record_stream(self._stream)
        else:
            for buffer, (start, end) in zip(buffers, self._pieces, strict=True):
                buffer.copy_(self._mirror[start:end])
        self._point(self._views(buffers, bases))
        self.parked = False
        self.stats["unparks"] += 1

    def _point(self, views: list[torch.Tensor]) -> None:
        """Every parameter, and every alias with its owner, at `views`."""
        for p, view in zip(self._params, views, strict=True):
            p.data = view
        for alias, owner in self._aliases:
            alias.data = owner.data

    def ensure(self) -> None:
        """Make the current stream wait for an `unpark()` copy still in flight (a no-op otherwise)."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None

    def describe(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "pieces": len(self._pieces),
            "parked": self.parked,
            "pinned": self._mirror.is_pinned(),
            **self.stats,
        }


def largest_layer_list(module: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The `nn.ModuleList` of `module` holding the most parameter bytes (a decoder's layer stack), or None."""
    best, best_bytes = None, 0
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 1:
            size = sum(p.numel() * p.element_size() for p in child.parameters())
            if size > best_bytes:
                best, best_bytes = child, size
    return best


class StreamedLayers:
    """A layer stack that lives in pinned host memory and visits the GPU one layer ahead of its use: the memory
    plan's `stream` tier for the text encoder (`ltx_mgpu.spec.placement`), for cards where the encoder cannot
    be on the GPU beside the transformer even for the encode (a 48 GB card: fp8 transformer 20 GiB + Gemma
    22.7 GiB + the rest).

    Each layer is a `ParkableWeights`, parked from the start. A forward pre-hook on layer i waits for its copy
    (started by layer i-1's hook, or now for the first) and starts layer i+1's, so the copies run on a side
    stream while the previous layer computes; a forward hook parks layer i once the current stream has run it.
    At most two layers are on the GPU at once (a forward that fails part-way leaves those two, and the next
    forward's hooks take them as they come); the rest of the module (embeddings, norms) stays where it is.
    Every forward copies the whole stack once (Gemma 12B: 20.1 GiB, ~0.4 s at 50 GB/s): fine for one encode a
    job; prompt enhancement (one forward per generated token) would pay it per token, so the runners refuse it
    on such a fleet.

    On CPU ranks the same hooks run (the "GPU copy" is a second host tensor): the bookkeeping is tested there.
    """

    def __init__(self, layers: torch.nn.ModuleList, device: torch.device) -> None:
        self.layers = list(layers)
        self.device = torch.device(device)
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # (copies in layer order)
        self.units = [ParkableWeights(layer, self.device, side) for layer in self.layers]
        for unit in self.units:
            unit.park()
        self.nbytes = sum(unit.nbytes for unit in self.units)
        self.largest_layer_bytes = max((unit.nbytes for unit in self.units), default=0)
        self.stats = {"forwards": 0, "copies": 0}
        for i, layer in enumerate(self.layers):  # (for the module's life: nothing takes the stream off again)
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after(i))

    def _before(self, i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            del module, args
            unit = self.units[i]
            if i == 0:
                self.stats["forwards"] += 1
            if unit.parked:  # (the first layer, or a forward that skipped ahead): copied now, waited for below
                unit.unpark()
                self.stats["copies"] += 1
            unit.ensure()
            if i + 1 < len(self.units) and self.units[i + 1].parked:
                self.units[i + 1].unpark()  # the next layer's copy runs beside this layer's compute
                self.stats["copies"] += 1

        return hook

    def _after(self, i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            del module, args, output
            self.units[i].park()  # (waits for the current stream: this layer's kernels have run)

        return hook

    def describe(self) -> dict[str, Any]:
        return {
            "layers": len(self.units),
            "bytes": self.nbytes,
            "largest_layer_bytes": self.largest_layer_bytes,
            "on_device": sum(not unit.parked for unit in self.units),
            "pinned": all(unit._mirror.is_pinned() for unit in self.units),
            **self.stats,
        }


def compute_on_host(module: torch.nn.Module, device: torch.device) -> None:
    """Run `module` where its weights are (the host) for the rest of its life: its tensor arguments move to the
    host before each forward and its tensor outputs (nested too) move to `device` after. For a part whose
    weights cost the card more than its compute costs the CPU: an embedding table's lookup (a gather of a few
    thousand rows), or parts a fleet never runs (kept correct should something call them)."""
    from accelerate.utils import send_to_device  # (nested outputs: tuples, dicts, model outputs)

    host = next((p.device for p in module.parameters()), torch.device("cpu"))

    def before(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        del mod
        return send_to_device(args, host), send_to_device(kwargs, host)

    def after(mod: torch.nn.Module, args: Any, output: Any) -> Any:
        del mod, args
        return send_to_device(output, device)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def stream_module(
    module: torch.nn.Module, device: torch.device, on_host: Sequence[torch.nn.Module] = ()
) -> StreamedLayers:
    """`module` (loaded on the host) with its largest layer stack streamed to `device` (`StreamedLayers`), the
    submodules in `on_host` left on the host and run there (`compute_on_host`), and everything else moved to
    `device`: its other parameters and every buffer, the stack's own included (`ParkableWeights` moves
    parameters only). The device never holds the whole module, not even while loading."""
    layers = largest_layer_list(module)
    if layers is None:
        raise ValueError(f"placement 'stream': {type(module).__name__} has no layer stack to stream")
    streamed = StreamedLayers(layers, device)
    kept = {id(p) for part in on_host for p in part.parameters()}
    kept_modules = {id(sub) for part in on_host for sub in part.modules()}
    in_stack = {id(p) for p in layers.parameters()}
    for sub in module.modules():  # (a tied weight cannot be in both places: its other user stays too)
        if id(sub) not in kept_modules and any(id(p) in kept for p in sub.parameters(recurse=False)):
            raise ValueError(f"placement 'stream': {type(sub).__name__} shares a weight with a part kept on the host")
    with torch.no_grad():
        for param in module.parameters():
            if id(param) not in in_stack and id(param) not in kept:
                param.data = param.data.to(device, copy=True)  # (a second host copy on CPU ranks, as the stack's)
        for sub in module.modules():
            if id(sub) in kept_modules:
                continue
            for name, buf in list(sub._buffers.items()):
                if buf is not None:
                    sub._buffers[name] = buf.to(device, copy=True)
    for part in on_host:
        compute_on_host(part, device)
    return streamed
