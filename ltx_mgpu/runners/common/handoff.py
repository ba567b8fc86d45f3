"""The end of a render on the driver rank: the video leaves the fleet, as an mp4 or as frames.

Why two ways: a fleet that encodes its own mp4 holds every GPU of the group for the whole encode (1.3 s of
a 4.1 s distilled render at 768x512 on one H200, 3.1 s at 1536x1024), and H100/H200 have no NVENC. With
`media="frames"` the driver converts the decoded frames to yuv420p on the device (half the bytes of RGB,
no swscale; CPU ranks use swscale), copies them once into shared memory (page-locked for that copy: one
DMA) and yields them with the waveform (`media_event`); the controller receives the tensors without
pickling and the fleet is free for the next job while the caller (the worker's encoder) writes the mp4.
`media="mp4"` keeps the self-contained path for controller users.

`media="stream"` (`FrameStream`) hands the frames off while the VAE still decodes, so the encoder starts
on the first frames instead of after the last: the driver allocates the whole video's yuv420p buffer in
shared memory up front (page-locked for the whole decode) and yields it at once (`media_open`); each
decoded chunk of final frames is converted, copied into its place (the copy synchronised before the
event) and announced (`media_frames`: frames [0, ready) are final and never written again); the audio
follows in the closing `media` event (`streamed: True`, no `video`). A runner whose decode is one piece
(no temporal chunks) announces every frame at once, before the audio decode. The caller's side is
`ltx_mgpu.media.mp4_stream.Mp4Stream`. Whatever ends the render early (an error, a cancellation, out of
memory), the buffer is unlocked (`FrameStream.release`, in a `finally`) and freed with its last reference.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from typing import Any

import torch

from ...control.events import MEDIA, MEDIA_FRAMES, MEDIA_OPEN, Stage, stage_event
from ...media.mp4 import (
    AudioTrack,
    EncodeOptions,
    media_event,
    page_lock,
    shared_empty,
    shared_host_copy,
    to_yuv420p,
    write_mp4,
)
from .args import RenderArgs
from .stages import StageClock

__all__ = ["FrameStream", "deliver_video", "stream_video"]


class FrameStream:
    """Driver only: one video's streamed hand-off (see the module docstring). `put` chunks in frame order."""

    def __init__(self, *, frames: int, width: int, height: int, fps: float, device: torch.device) -> None:
        self.total, self.width, self.height, self.fps = int(frames), int(width), int(height), float(fps)
        self.device = torch.device(device)
        self.buffer = shared_empty((self.total, self.height * 3 // 2, self.width), torch.uint8)
        self.ready = 0
        nbytes = self.buffer.numel()
        self._locked = self.device.type == "cuda" and nbytes > 0 and page_lock(self.buffer, nbytes)

    def open_event(self) -> dict[str, Any]:
        return {
            "type": MEDIA_OPEN,
            "video": self.buffer,
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames": self.total,
        }

    def put(self, frames: torch.Tensor) -> dict[str, Any]:
        """uint8 frames (f, H, W, 3) that follow the ones already put: converted on their device, copied
        into their place (complete before this returns) and announced by the returned event."""
        n = int(frames.shape[0])
        if self.ready + n > self.total or tuple(frames.shape[1:]) != (self.height, self.width, 3):
            raise RuntimeError(f"frame stream: {n} frames {tuple(frames.shape)} after {self.ready} of {self.total}")
        target = self.buffer[self.ready : self.ready + n]
        yuv = to_yuv420p(frames)
        if self._locked:
            target.copy_(yuv, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            target.copy_(yuv)
        self.ready += n
        return {"type": MEDIA_FRAMES, "ready": self.ready, "frames": self.total, "at": time.monotonic()}

    def close_event(self, track: AudioTrack | None) -> dict[str, Any]:
        if self.ready != self.total:
            raise RuntimeError(f"frame stream closed with {self.ready} of {self.total} frames")
        return {
            "type": MEDIA,
            "streamed": True,
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames": self.total,
            "audio": None if track is None else shared_host_copy(track.waveform.detach().float()),
            "audio_sample_rate": None if track is None else int(track.sample_rate),
        }

    def release(self) -> None:
        """Unlock the pages (safe to repeat); the buffer is freed with its last reference."""
        if self._locked:
            self._locked = False
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())


def stream_video(
    clock: StageClock, stream: FrameStream | None, chunks: Iterable[torch.Tensor | None]
) -> Generator[dict[str, Any], None, None]:
    """Every rank: run the decode `chunks` (uint8 frames on the driver, None elsewhere) under the `decode`
    stage; the driver (`stream` not None) yields the buffer first, then one `media_frames` per chunk. The
    conversion and copies are timed apart as `handoff` (and taken out of `decode`)."""
    handoff = 0.0
    try:
        if stream is not None:
            yield stream.open_event()
        with clock.stage(Stage.DECODE):
            for frames in chunks:
                if stream is None or frames is None:
                    continue
                if stream.device.type == "cuda":  # (the chunk's decode is the decode's, not the copy's)
                    torch.cuda.synchronize(stream.device)
                t0 = time.perf_counter()
                event = stream.put(frames)
                handoff += time.perf_counter() - t0
                yield event
    finally:
        if stream is not None:
            stream.release()
    if stream is not None and Stage.DECODE in clock.timings_s:
        clock.timings_s[Stage.DECODE] = round(max(0.0, clock.timings_s[Stage.DECODE] - handoff), 6)
        clock.timings_s[Stage.HANDOFF] = round(handoff, 6)


def deliver_video(
    clock: StageClock,
    args: RenderArgs,
    frames: torch.Tensor,
    fps: float,
    track: AudioTrack | None,
    options: EncodeOptions | None = None,
) -> Generator[dict[str, Any], None, int]:
    """Driver only: uint8 frames (F, H, W, 3, on the device that decoded them) out of the fleet as the
    request asks. Returns the mp4's size in bytes (0 for a hand-off: the encoder learns it). `stream`
    from a runner that decoded the whole video already: the stream protocol with one chunk."""
    if args.media == "stream":
        stream = FrameStream(
            frames=int(frames.shape[0]),
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
            fps=fps,
            device=frames.device,
        )
        try:
            yield stream.open_event()
            with clock.stage(Stage.HANDOFF):
                event = stream.put(frames)
            yield event
        finally:
            stream.release()
        yield stream.close_event(track)
        return 0
    if args.media == "frames":
        with clock.stage(Stage.HANDOFF):  # device work: the conversion, then the one copy to the host
            yuv = shared_host_copy(to_yuv420p(frames))
        yield media_event(yuv, width=int(frames.shape[2]), height=int(frames.shape[1]), fps=fps, audio=track)
        return 0
    yield stage_event(Stage.MUX)
    with clock.stage(Stage.MUX):
        return write_mp4(frames, args.output_path, fps, audio=track, options=options)
