"""The end of a render on the driver rank: the video leaves the fleet, as an mp4 or as frames.

Why two ways: a fleet that encodes its own mp4 holds every GPU of the group for the whole encode (1.3 s of
a 4.1 s distilled render at 768x512 on one H200, 3.1 s at 1536x1024), and H100/H200 have no NVENC. With
`media="frames"` the driver converts the decoded frames to yuv420p on the device (half the bytes of RGB,
no swscale; CPU ranks use swscale), copies them once into shared memory (page-locked for that copy: one
DMA) and yields them with the waveform (`media_event`); the controller receives the tensors without
pickling and the fleet is free for the next job while the caller (the worker's encoder) writes the mp4.
`media="mp4"` keeps the self-contained path for controller users.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ...control.events import Stage, stage_event
from .args import RenderArgs
from .media import AudioTrack, EncodeOptions, media_event, shared_host_copy, to_yuv420p, write_mp4
from .stages import StageClock

__all__ = ["deliver_video"]


def deliver_video(
    clock: StageClock,
    args: RenderArgs,
    frames: torch.Tensor,
    fps: float,
    track: AudioTrack | None,
    options: EncodeOptions | None = None,
) -> Generator[dict[str, Any], None, int]:
    """Driver only: uint8 frames (F, H, W, 3, on the device that decoded them) out of the fleet as the
    request asks. Returns the mp4's size in bytes (0 for a hand-off: the encoder learns it)."""
    if args.media == "frames":
        with clock.stage(Stage.HANDOFF):  # device work: the conversion, then the one copy to the host
            yuv = shared_host_copy(to_yuv420p(frames))
        yield media_event(yuv, width=int(frames.shape[2]), height=int(frames.shape[1]), fps=fps, audio=track)
        return 0
    yield stage_event(Stage.MUX)
    with clock.stage(Stage.MUX):
        return write_mp4(frames, args.output_path, fps, audio=track, options=options)
