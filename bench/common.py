"""What every benchmark shares: its output contract and its clocks.

Output: each measurement is one JSON line on stdout (`emit`, also appended to an `--out` file where a bench
takes one), and the last line is `SUMMARY {...}` (`emit_summary`), so a session log, a CI test and a reader
all find the result the same way: `grep '^SUMMARY'`. Progress goes to stderr (`say`), never between the
JSON lines.

Clocks: `time_ms` times a callable on its device (CUDA events around the loop on a GPU, so nothing but the
device work between the events counts; `perf_counter` on the CPU), `cuda_graph` captures a callable as the
runners replay their denoising forwards, `pct` is the nearest-rank percentile every report uses. torch is
imported inside the functions that need it, so the service benchmarks (Redis, S3, no tensors) import this
module without it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["cuda_graph", "emit", "emit_summary", "ltx_core_available", "pct", "rel_err", "say", "time_ms"]


def emit(record: dict[str, Any], out: IO[str] | None = None) -> None:
    """One measurement: a JSON line on stdout (flushed, so a killed run keeps what it measured), and on `out`."""
    line = json.dumps(record, default=str)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def emit_summary(summary: dict[str, Any], out: IO[str] | None = None) -> None:
    """The run's last line, `SUMMARY {...}`, on stdout and on `out`."""
    line = "SUMMARY " + json.dumps(summary, default=str)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def say(tag: str, text: str) -> None:
    """Progress for the person watching, on stderr: `[tag HH:MM:SS] text`."""
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100; nearest rank on the sorted values); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> float:
    """Milliseconds per call of `fn` after `warmup` untimed calls: on a GPU, CUDA events around the `iters`
    calls with no host synchronisation inside (launch overhead hidden by queued work is not counted); on
    the CPU, wall clock."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def cuda_graph(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], Any], Any]:
    """(replay, the captured call's output): `fn` captured in a CUDA graph (as the runners run every
    denoising forward) after two warm-up calls on a side stream (Triton compiles, the bias probe runs);
    (fn, None) where capture fails (a JSON `note` line says why) or on CPU."""
    import torch

    if device.type != "cuda":
        return fn, None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except RuntimeError as exc:
        emit({"kind": "note", "graph_capture_failed": str(exc)[:500]})
        return fn, None
    return graph.replay, out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32, 5 decimals: how far `a` is from the reference `b`."""
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)


def ltx_core_available() -> bool:
    """Whether ltx-core imports (the GPU hosts' bare image has no ltx-core: benches fall back to stand-ins)."""
    try:
        import ltx_core  # noqa: F401
    except ImportError:
        return False
    return True
