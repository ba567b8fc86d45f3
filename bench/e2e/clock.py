"""The fleet's clock under a backlog, from the job records of `python -m bench.e2e` (`bench.e2e.stack.job_record`).

Why a module of its own: what the numbers mean is the point. `gpu_window` is the runner's own first-to-last
device work of a job (wall clock between device syncs), so the gap from one job's window to the next one's
is time every GPU of the fleet sat idle, an encode or any other CPU tail on the fleet included; the `busy`
window (first runner event to the output event) hid an mp4 encode that ran before the output event.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from bench.common import pct

__all__ = ["denoise_beside_encode", "encode_window", "gpu_busy_ratio", "idle_gaps_ms", "worker_encode_stages"]


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


#: the fleet's idle gap between two jobs of one worker, cut at the events that mark it (one host's wall clock)
IDLE_PARTS = (
    ("fleet_to_output", lambda prev, nxt: prev["busy"][1] - prev["gpu_window"][1]),  # last device work -> output
    ("output_to_started", lambda prev, nxt: nxt["started_at"] - prev["busy"][1]),  # job return, RQ, dequeue
    ("started_to_rendering", lambda prev, nxt: nxt["rendering_at"] - nxt["started_at"]),  # the job's own checks
    ("rendering_to_device", lambda prev, nxt: nxt["gpu_window"][0] - nxt["rendering_at"]),  # to the fleet
)


def idle_parts_ms(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """p50 of each part of the fleet's idle gap between consecutive jobs of a worker (`IDLE_PARTS`): where
    the time between one job's last device work and the next job's first goes."""
    parts: dict[str, list[float]] = {name: [] for name, _ in IDLE_PARTS}
    for worker in _windows(records, "gpu_window"):
        mine = sorted((r for r in records if r["worker"] == worker and r.get("gpu_window")),
                      key=lambda r: r["gpu_window"][0])  # fmt: skip
        for prev, nxt in pairwise(mine):
            if prev.get("busy") and nxt.get("started_at") and nxt.get("rendering_at"):
                for name, part in IDLE_PARTS:
                    parts[name].append(1000 * part(prev, nxt))
    return {name: None if not v else round(pct(v, 50), 2) for name, v in parts.items()}  # type: ignore[arg-type]


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


def worker_encode_stages(rendered: dict[str, Any]) -> dict[str, float]:
    """`rendered`'s encode seconds as stage names: `worker_encode` (the whole encode) and, for a streamed
    hand-off, `worker_encode_overlap` / `worker_encode_tail` (its seconds before / after the decode ended)."""
    fields = {"encode_s": "", "encode_overlap_s": "_overlap", "encode_tail_s": "_tail"}
    return {f"worker_encode{name}": float(rendered[k]) for k, name in fields.items() if rendered.get(k) is not None}


def encode_window(rendered: dict[str, Any]) -> list[float] | None:
    """The worker's mp4 encode of a job, wall clock: its `rendered` state event is written when the encode
    ends, `encode_s` after it began."""
    if rendered.get("encode_s") is None or rendered.get("ts") is None:
        return None
    end = float(rendered["ts"])
    return [end - float(rendered["encode_s"]), end]


DENOISE = ("stage1", "upsample", "stage2")  #: the transformer's stages, whose speed the encode must not cost


def _denoise_s(rec: dict[str, Any]) -> float | None:
    stages = rec.get("stages_s") or {}
    return sum(float(stages[k]) for k in DENOISE if k in stages) if "stage1" in stages else None


def denoise_beside_encode(alone: list[dict[str, Any]], backlog: list[dict[str, Any]]) -> dict[str, Any]:
    """Does the worker's encode of one video slow the denoising of the next one, which runs beside it?

    `alone`: jobs run one at a time (each waits for the last upload, so no encode runs beside it); from
    `backlog`, the jobs whose device window overlaps the encode window of another job of the same worker for
    at least half of that encode. Their denoising seconds (stage 1 + upsample + stage 2, the runner's clock
    between device syncs) are compared p50 to p50, in the same run on the same fleet.
    """
    beside = []
    for worker in _windows(backlog, "gpu_window"):
        encodes = [r["encode_window"] for r in backlog if r["worker"] == worker and r.get("encode_window")]
        for rec in backlog:
            if rec["worker"] != worker or not rec.get("gpu_window") or _denoise_s(rec) is None:
                continue
            start, end = rec["gpu_window"]
            if any(min(end, e1) - max(start, e0) >= 0.5 * (e1 - e0) > 0 for e0, e1 in encodes):
                beside.append(_denoise_s(rec))
    quiet = [d for d in map(_denoise_s, alone) if d is not None]
    p_quiet, p_beside = pct(quiet, 50), pct(beside, 50)
    return {
        "denoise_alone_p50_s": None if p_quiet is None else round(p_quiet, 4),
        "denoise_beside_encode_p50_s": None if p_beside is None else round(p_beside, 4),
        "jobs_beside_encode": len(beside),
        "ratio": round(p_beside / p_quiet, 4) if p_quiet and p_beside else None,
    }
