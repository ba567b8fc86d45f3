"""`CudaGraphForward`: the transformer forward of a denoising step captured once per shape in a CUDA
graph and replayed, so a step costs the GPU time of its kernels and not the host time of launching them.

A denoising stage repeats the same shapes tens of times. Per key (caller scope such as the active layout,
the shapes/dtypes/broadcast pattern of every input tensor, the perturbation configuration):

- call 1: eager (a shape seen once is never captured; lazy initialisation happens here);
- call 2: inputs copied into static buffers, one warm-up forward on a side stream (its output is this
  call's result), then capture on that stream into the memory pool all graphs share;
- later calls: inputs copied into the static buffers, `graph.replay()`, outputs cloned.

Captured with the graph: the exchange buffers and token tables of the SP attention (the ipc kernel bakes
its per-rank counts and buffer pointers into the launch; `dist` bakes its split sizes), NCCL collectives
(all-gather of the video tokens, audio broadcast), RoPE and masks computed from the static inputs (the
hoisting caches are bypassed during capture: `capture_cache.capture_scope`). Outputs are cloned after a replay
(a later replay of the same graph would overwrite them; the clone is a few hundred KB).

Falls back to eager, with the reason logged once and kept in `reasons`/`last_path`, never failing a job:
- not CUDA (CPU ranks: the wrapper is a transparent pass-through), or `capturable()` names a reason (a
  gloo group on GPU tensors stages through the host, which a graph cannot contain);
- the capture raised (anything that breaks the capture rules: a host sync, a host->device copy, a
  non-capturable collective). With `agree` (a collective over the ranks, e.g. a gloo all-reduce), every
  rank keeps its graph only if every rank captured one, so all ranks take the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .capture_cache import capture_scope
from .hoist import perturbation_signature

__all__ = ["CudaGraphBackend", "CudaGraphForward", "GraphStats"]

log = logging.getLogger("ltx_mgpu.parallel.graphs")


@dataclass
class GraphStats:
    """What ran, for the benchmark and the stage events."""

    eager: int = 0  #: eager calls (first calls, disabled wrapper, failed keys)
    captured: int = 0  #: graphs captured
    replayed: int = 0  #: graph replays
    failed: int = 0  #: captures that failed (the key then stays eager)
    capture_s: float = 0.0  #: wall time spent in warm-up + capture

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# =========================================================================================================
# Static input buffers
# =========================================================================================================


def _zero_stride_dims(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1)


@dataclass
class _Slot:
    """A static input: `base` is written, `view` (base expanded over broadcast dims) is what fn sees."""

    base: torch.Tensor
    view: torch.Tensor
    broadcast: tuple[int, ...]

    @classmethod
    def like(cls, t: torch.Tensor) -> _Slot:
        dims = _zero_stride_dims(t)
        shape = [1 if d in dims else n for d, n in enumerate(t.shape)]
        base = torch.empty(shape, dtype=t.dtype, device=t.device)
        return cls(base, base.expand(t.shape) if dims else base, dims)

    def load(self, t: torch.Tensor) -> None:
        for d in self.broadcast:
            t = t.narrow(d, 0, 1)  # identical along a broadcast dim: the key guarantees the same pattern
        self.base.copy_(t)


def _token_rows(latent: torch.Tensor) -> int:
    """Batch x tokens of a (batch, tokens, channels) latent (its element count over its channels)."""
    return latent.numel() // max(1, int(latent.shape[-1])) if latent.dim() else 0


def _spec(value: Any) -> Hashable:
    """What a captured graph depends on for one argument (tensor layout, or the Python value)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device, _zero_stride_dims(value))
    if value is None or isinstance(value, bool | int | float | str):
        return ("V", value)
    raise TypeError(f"CudaGraphForward cannot key an argument of type {type(value).__name__}")


def _fields(modality: Any) -> list[tuple[str, Any]]:
    if modality is None:
        return []
    return [(f.name, getattr(modality, f.name)) for f in dataclasses.fields(modality)]


@dataclass
class _Entry:
    """One captured key."""

    graph: Any  #: torch.cuda.CUDAGraph
    slots: dict[tuple[int, str], _Slot]  #: (argument index, field name) -> static buffer
    outputs: tuple[torch.Tensor | None, ...]


@dataclass
class _KeyState:
    calls: int = 0
    entry: _Entry | None = None
    failed: str | None = None


# =========================================================================================================
# CUDA (the only real backend; tests substitute one that runs on CPU to check the bookkeeping)
# =========================================================================================================


class CudaGraphBackend:
    """The CUDA calls of capture and replay, kept apart so the wrapper's logic is testable on CPU."""

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def on_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        """`torch.cuda.graph` on `stream`; whatever happens, the caller's current stream is current again
        afterwards (`torch.cuda.graph` leaves the capture stream current when ending a broken capture
        raises)."""
        previous = torch.cuda.current_stream()
        try:
            # thread_local: other threads of the rank (the NCCL watchdog, heartbeats) may touch CUDA meanwhile
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                yield
        finally:
            if torch.cuda.current_stream() != previous:
                torch.cuda.set_stream(previous)


# =========================================================================================================
# The wrapper
# =========================================================================================================


class CudaGraphForward:
    """Capture/replay wrapper of `fn(video, audio, perturbations) -> (video_out, audio_out)`.

    Args:
        fn: the forward (e.g. ltx-core's `X0Model` around the SP wrapper).
        enabled: False makes every call eager.
        key_fn: extra key of the caller's state that changes the computation (the router's active layout).
        capturable: `() -> None | reason`; a reason keeps the current call eager (e.g. a gloo SP group).
        agree: `(ok: bool) -> bool`, a collective AND over the ranks that run this forward together.
        capture_after: the call of a key that captures (2: shapes seen once stay eager).
        max_graphs: graphs kept (least recently used dropped first).
        max_capture_rows: a forward whose video input has more token-rows (batch x tokens, as this wrapper sees
            it) runs eager, never captured: long kernels hide their launches, and its pool would hold a whole
            forward's intermediates (`memory_profile.MAX_CAPTURE_TOKEN_ROWS` a rank). None: no bound.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        enabled: bool = True,
        key_fn: Callable[[], Hashable] | None = None,
        capturable: Callable[[], str | None] | None = None,
        agree: Callable[[bool], bool] | None = None,
        capture_after: int = 2,
        max_graphs: int = 16,
        max_capture_rows: int | None = None,
        backend: CudaGraphBackend | None = None,
    ) -> None:
        if capture_after < 2:
            raise ValueError("capture_after must be >= 2 (the first call of a shape runs eager)")
        self.fn = fn
        self.enabled = enabled
        self.key_fn = key_fn
        self.capturable = capturable
        self.agree = agree
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.max_capture_rows = max_capture_rows
        self.backend = backend or CudaGraphBackend()
        self.stats = GraphStats()
        self.reasons: dict[str, int] = {}  #: eager reason -> how often
        self.last_path = ""
        self._keys: OrderedDict[Hashable, _KeyState] = OrderedDict()
        self._pool: Any = None

    # ---- public --------------------------------------------------------------------------------------
    def __call__(self, video: Any, audio: Any, perturbations: Any) -> Any:
        reason = self._eager_reason(video)
        if reason is not None:
            return self._eager(reason, video, audio, perturbations)
        key = self._key(video, audio, perturbations)
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState()
        self._keys.move_to_end(key)
        state.calls += 1
        if state.failed is not None:
            return self._eager(f"capture failed earlier: {state.failed}", video, audio, perturbations)
        if state.entry is not None:
            return self._replay(state.entry, video, audio)
        if state.calls < self.capture_after:
            return self._eager("first call of this shape", video, audio, perturbations)
        return self._capture(state, video, audio, perturbations)

    def reset(self) -> None:
        """Drop every graph and every call count, and the pool they shared: once no graph holds it, its memory
        goes back to the allocator (`torch.cuda.empty_cache()` returns it to the device); later captures start
        a new pool."""
        self._keys.clear()
        self._pool = None

    @property
    def graphs(self) -> int:
        return sum(1 for s in self._keys.values() if s.entry is not None)

    def describe(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "graphs": self.graphs, **self.stats.as_dict(), "eager_reasons": self.reasons}

    # ---- paths ---------------------------------------------------------------------------------------
    def _eager_reason(self, video: Any) -> str | None:
        if not self.enabled:
            return "graphs disabled"
        device = getattr(getattr(video, "latent", None), "device", None)
        if device is None or not self.backend.supports(device):
            return "not CUDA"
        if self.max_capture_rows is not None and _token_rows(video.latent) > self.max_capture_rows:
            return f"over {self.max_capture_rows} token-rows: launches are hidden, a pool would not be"
        return self.capturable() if self.capturable is not None else None

    def _eager(self, reason: str, video: Any, audio: Any, perturbations: Any) -> Any:
        self.stats.eager += 1
        if reason not in self.reasons:
            log.info("CUDA graph: eager forward (%s)", reason)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.last_path = f"eager: {reason}"
        return self.fn(video, audio, perturbations)

    def _key(self, video: Any, audio: Any, perturbations: Any) -> Hashable:
        extra = self.key_fn() if self.key_fn is not None else None
        specs = tuple(tuple((name, _spec(value)) for name, value in _fields(m)) for m in (video, audio))
        pert = None if perturbations is None else perturbation_signature(perturbations)
        return (extra, specs, pert)

    def _replay(self, entry: _Entry, video: Any, audio: Any) -> Any:
        self._load(entry.slots, video, audio)
        entry.graph.replay()
        self.stats.replayed += 1
        self.last_path = "graph: replay"
        return tuple(None if t is None else t.clone() for t in entry.outputs)

    def _capture(self, state: _KeyState, video: Any, audio: Any, perturbations: Any) -> Any:
        started = time.perf_counter()
        slots: dict[tuple[int, str], _Slot] = {}
        statics = []
        for index, modality in enumerate((video, audio)):
            if modality is None:
                statics.append(None)
                continue
            changes = {}
            for name, value in _fields(modality):
                if isinstance(value, torch.Tensor):
                    slot = slots[(index, name)] = _Slot.like(value)
                    changes[name] = slot.view
            statics.append(dataclasses.replace(modality, **changes))
        self._load(slots, video, audio)
        device = video.latent.device
        backend = self.backend
        current = backend.current_stream(device)
        side = backend.side_stream(device)
        side.wait_stream(current)
        with backend.on_stream(side):
            result = self.fn(statics[0], statics[1], perturbations)  # warm-up: a real forward, this call's answer
        for t in result:
            if t is not None:
                backend.record_stream(t, current)  # allocated on `side`, consumed on the caller's stream
        graph = backend.new_graph()
        error: str | None = None
        outputs: Any = None
        try:
            if self._pool is None:
                self._pool = backend.new_pool()
            with capture_scope(), backend.capture(graph, self._pool, side):
                outputs = self.fn(statics[0], statics[1], perturbations)
        except Exception as exc:  # any broken capture rule: stay eager for this key, never fail the job
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        current.wait_stream(side)
        ok = error is None
        if self.agree is not None:
            agreed = bool(self.agree(ok))
            if ok and not agreed:
                error = "another rank could not capture this forward"
            ok = agreed
        self.stats.capture_s += time.perf_counter() - started
        if not ok:
            state.failed = error or "capture failed"
            self.stats.failed += 1
            log.warning("CUDA graph capture failed, staying eager for this shape: %s", state.failed)
            self.last_path = f"eager: capture failed ({state.failed})"
            return result
        state.entry = _Entry(graph, slots, tuple(outputs))
        self.stats.captured += 1
        self.last_path = "graph: captured (this call ran the warm-up)"
        self._evict()
        return result

    def _load(self, slots: dict[tuple[int, str], _Slot], video: Any, audio: Any) -> None:
        for (index, name), slot in slots.items():
            slot.load(getattr(video if index == 0 else audio, name))

    def _evict(self) -> None:
        captured = [k for k, s in self._keys.items() if s.entry is not None]
        for key in captured[: max(0, len(captured) - self.max_graphs)]:
            self._keys[key].entry = None
            self._keys[key].calls = 0
