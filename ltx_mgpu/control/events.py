"""The small, JSON-safe event dicts runners yield and services relay.

A runner yields these on the driver rank only (other ranks yield nothing), so a service sees each event
once. Every event is a plain `dict` with a `type` key; values are JSON-serialisable so a service can put
them into a Redis Stream unchanged.

- `{"type": "stage", "stage": str}`: a new stage begins (a `Stage`: "encode", "denoise", "decode", "mux", ...).
- `{"type": "progress", "stage": str, "step": int, "total": int}`: `step` of `total` done in `stage`.
- `{"type": "output", "path": str, "frames": int, "fps": float, "width": int, "height": int,
   "bytes": int, "content_type": str}`: a finished file on the driver rank's filesystem.
- `{"type": "media", "video": uint8 tensor, ...}`: with `media="frames"`, the frames to encode (not JSON:
  the caller consumes it; `ltx_mgpu.media.mp4.media_event`).
- With `media="stream"` (`ltx_mgpu.runners.common.handoff.FrameStream`): `{"type": "media_open", "video":
  uint8 tensor, "frames": int, ...}` as the decode starts (the whole video's buffer, still empty), one
  `{"type": "media_frames", "ready": int, "at": float}` per decoded chunk (frames [0, ready) are final), then
  `{"type": "media", "streamed": True, "audio": ...}` without `video`. Never relayed either.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

__all__ = [
    "MEDIA",
    "MEDIA_FRAMES",
    "MEDIA_OPEN",
    "OUTPUT",
    "PROGRESS",
    "STAGE",
    "Stage",
    "output_event",
    "progress_event",
    "stage_event",
]

#: The `type` of each runner event (the worker relays them under the same names: `ltx_contract.states.EventType`).
STAGE = "stage"
PROGRESS = "progress"
OUTPUT = "output"
#: frames and audio handed off for encoding outside the fleet (tensors: never relayed; see runners.common.handoff)
MEDIA = "media"
MEDIA_OPEN = "media_open"  #: a streamed hand-off begins: the video's buffer (filled as `media_frames` announce)
MEDIA_FRAMES = "media_frames"  #: frames [0, ready) of the streamed buffer are final


class Stage(StrEnum):
    """The stages runners announce: `stage` and `progress` events and the keys of an output's `timings_s`.
    A runner may announce others; these are the ones the built-in runners use."""

    ENCODE = "encode"  #: text (and image) encoding
    DENOISE = "denoise"  #: the denoising loop of a one-stage runner (smoke, noop)
    STAGE1 = "stage1"  #: LTX-2 stage 1: denoising at half resolution
    UPSAMPLE = "upsample"  #: LTX-2: the latent spatial upsampler between the stages
    STAGE2 = "stage2"  #: LTX-2 stage 2: refinement at full resolution
    DECODE = "decode"  #: the video VAE decode
    AUDIO_DECODE = "audio_decode"  #: the audio VAE decode and vocoder
    MUX = "mux"  #: writing the mp4 (video and audio tracks)
    HANDOFF = "handoff"  #: yuv420p frames converted on the device and copied out for an encoder beside the fleet


def stage_event(stage: str, **extra: Any) -> dict[str, Any]:
    return {"type": STAGE, "stage": stage, **extra}


def progress_event(stage: str, step: int, total: int, **extra: Any) -> dict[str, Any]:
    return {"type": PROGRESS, "stage": stage, "step": int(step), "total": int(total), **extra}


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
        "type": OUTPUT,
        "path": str(path),
        "frames": int(frames),
        "fps": float(fps),
        "width": int(width),
        "height": int(height),
        "bytes": int(size_bytes),
        "content_type": content_type,
        **extra,
    }
