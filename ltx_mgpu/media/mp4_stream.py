"""The encoder's side of a streamed hand-off (`media="stream"`, `handoff.FrameStream`): x264 runs start while
the fleet still decodes.

`Mp4Stream(open_event, options)` takes the `media_open` event (the whole video's yuv420p buffer in shared
memory, still filling) and cuts the video into the runs `write_mp4_yuv` would cut (same count, same bounds:
`EncodeOptions.segment_count`, `x264_segments.segment_bounds`); `advance(media_frames event)` starts every run
whose frames are all final; `finish(closing media event)` returns the `media` dict the encoder writes
(`write_mp4_yuv(..., stream=...)` muxes the runs already encoding, then the audio). Same runs on the same
frames with the same settings: the packets, and the file, are those of the one-shot encode (x264 is
deterministic at a given thread count). A one-run video (short clips, `segments=1`) is encoded at the end as
today. `abort()` when the render fails after `media_open`: the runs not started are cancelled, the running
ones end on their own, nothing waits for frames that will never come, and the buffer is freed with the
last reference to this object.

`timings(started, ended)`: how much of the encode overlapped the decode, on the host's monotonic clock (one
clock for every process on Linux: the runner stamps each `media_frames` event with it).
"""

from __future__ import annotations

import time
from typing import Any

from .mp4 import EncodeOptions, frame_rate_fraction, segment_settings
from .x264_segments import SegmentStream

__all__ = ["Mp4Stream"]


class Mp4Stream:
    """One streamed video on the encoder's side; see the module docstring."""

    def __init__(self, event: dict[str, Any], options: EncodeOptions) -> None:
        self.video = event["video"]
        self.width, self.height, self.fps = int(event["width"]), int(event["height"]), float(event["fps"])
        self.total = int(event["frames"])
        if tuple(self.video.shape) != (self.total, self.height * 3 // 2, self.width):
            raise ValueError(f"streamed video buffer {tuple(self.video.shape)} does not match its event")
        self.ready = 0
        self.aborted = False
        self.decoded_at: float | None = None  #: the runner's clock when the last frames were final
        segments = options.segment_count(self.total)
        self.runs: SegmentStream | None = None
        if segments > 1:
            self.runs = SegmentStream(
                self.video.numpy(),
                self.width,
                self.height,
                frame_rate_fraction(self.fps),
                segment_settings(options, segments),
                segments,
            )

    def advance(self, event: dict[str, Any]) -> None:
        if self.aborted:  # (a late event starts nothing)
            return
        self.ready = max(self.ready, min(int(event["ready"]), self.total))
        if self.ready >= self.total and self.decoded_at is None:
            self.decoded_at = float(event.get("at") or time.monotonic())
        if self.runs is not None:
            self.runs.advance(self.ready)

    def finish(self, event: dict[str, Any]) -> dict[str, Any]:
        """The closing `media` event -> the `media` dict of a whole hand-off, plus `stream` (this object)."""
        if self.ready < self.total or self.aborted:
            raise RuntimeError(
                f"streamed hand-off closed with {self.ready} of {self.total} frames"
                + (" after an abort" if self.aborted else "")
            )
        return {**event, "video": self.video, "frames": self.total, "stream": self}

    def abort(self) -> None:
        self.aborted = True
        if self.runs is not None:
            self.runs.abort()

    def started_at(self) -> float | None:
        """When the first run started encoding (None: no run yet, or a one-run video)."""
        if self.runs is None:
            return None
        done = [job for job in self.runs.jobs() if job.done() and not job.cancelled() and job.exception() is None]
        starts = [job.result().started for job in done]
        return min(starts) if starts else None

    def timings(self, started: float, ended: float) -> dict[str, float]:
        """`encode_overlap_s`: seconds of the encode (`started` to `ended`) before the video's decode ended;
        `encode_tail_s`: seconds of it after (what the stream leaves on the critical path)."""
        if self.decoded_at is None:
            return {}
        return {
            "encode_overlap_s": round(max(0.0, min(self.decoded_at, ended) - started), 4),
            "encode_tail_s": round(max(0.0, ended - max(started, self.decoded_at)), 4),
        }
