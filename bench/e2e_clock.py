"""The fleet's clock under a backlog, from the job records of `bench/e2e.py` (`e2e_stack.job_record`).

Why a module of its own: what the numbers mean is the point. `gpu_window` is the runner's own first-to-last
device work of a job (wall clock between device syncs), so the gap from one job's window to the next one's
is time every GPU of the fleet sat idle, an encode or any other CPU tail on the fleet included; the `busy`
window (first runner event to the output event) hid an mp4 encode that ran before the output event.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

__all__ = ["gpu_busy_ratio", "idle_gaps_ms", "pct"]


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _windows(records: list[dict[str, Any]], key: str) -> dict[str, list[list[float]]]:
    by_worker: dict[str, list[list[float]]] = {}
    for rec in records:
        if rec.get(key) and rec["worker"]:
            by_worker.setdefault(rec["worker"], []).append(rec[key])
    return by_worker


def idle_gaps_ms(records: list[dict[str, Any]], key: str = "busy") -> list[float]:
    """Per fleet (worker), the gaps between consecutive jobs' windows: `busy` (output event to the next
    job's first runner event) or `gpu_window` (last device work to the next job's first)."""
    by_worker = _windows(records, key)
    gaps = []
    for windows in by_worker.values():
        windows.sort()
        gaps += [(nxt[0] - prev[1]) * 1000 for prev, nxt in pairwise(windows)]
    return gaps


def gpu_busy_ratio(records: list[dict[str, Any]]) -> float | None:
    """Per fleet: device-busy seconds of its jobs over the span from the first one's first device work to
    the last one's last; the mean over fleets (None without the runner's clock)."""
    ratios = []
    for worker, windows in _windows(records, "gpu_window").items():
        busy = [float(r["gpu_busy_s"]) for r in records if r["worker"] == worker and r.get("gpu_window")]
        span = max(w[1] for w in windows) - min(w[0] for w in windows)
        if span > 0 and len(windows) > 1:
            ratios.append(sum(busy) / span)
    return round(sum(ratios) / len(ratios), 4) if ratios else None
