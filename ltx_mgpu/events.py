"""The small, JSON-safe event dicts runners yield and services relay.

A runner yields these on the driver rank only (other ranks yield nothing), so a service sees each event
once. Every event is a plain `dict` with a `type` key; values are JSON-serialisable so a service can put
them into a Redis Stream unchanged.

- `{"type": "stage", "stage": str}`: a new stage begins (e.g. "encode", "denoise", "decode", "mux").
- `{"type": "progress", "stage": str, "step": int, "total": int}`: `step` of `total` done in `stage`.
- `{"type": "output", "path": str, "frames": int, "fps": float, "width": int, "height": int,
   "bytes": int, "content_type": str}`: a finished file on the driver rank's filesystem.
"""

from __future__ import annotations

from typing import Any

__all__ = ["output_event", "progress_event", "stage_event"]


def stage_event(stage: str, **extra: Any) -> dict[str, Any]:
    return {"type": "stage", "stage": stage, **extra}


def progress_event(stage: str, step: int, total: int, **extra: Any) -> dict[str, Any]:
    return {"type": "progress", "stage": stage, "step": int(step), "total": int(total), **extra}


def output_event(
    path: str,
    *,
    frames: int,
    fps: float,
    width: int,
    height: int,
    size_bytes: int,
    content_type: str = "video/mp4",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "type": "output",
        "path": str(path),
        "frames": int(frames),
        "fps": float(fps),
        "width": int(width),
        "height": int(height),
        "bytes": int(size_bytes),
        "content_type": content_type,
        **extra,
    }
