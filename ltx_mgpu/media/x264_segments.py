"""Segment-parallel H.264: contiguous runs of frames, each through its own x264 in a thread, joined by the muxer.

Why: one x264 with frame threads stops scaling before a many-core host's cores run out (on the GPU host's 16
cores a 768x512 noise clip used ~7 of them), and its lookahead and the B-frame chain keep frames waiting
on each other; independent runs do not. Each run starts with an IDR frame, has the same settings (so the
same SPS/PPS as the stream's own encoder, which writes the header: the caller checks `extradata`) and the
same B-frame delay, so decode timestamps stay increasing across the joins. The cost: one IDR per run
(nothing on noise, a few percent on smooth content), so runs stay at least `min_frames` long.

Threads, not processes: PyAV releases the GIL while libavcodec encodes (`avcodec_send_frame`,
`avcodec_receive_packet`), so x264s in threads of one process run side by side (measured: a pure-Python
loop kept 67% of its speed on 2 busy cores while another thread encoded), read the frames where they are
(the fleet's shared memory, no copy) and hand back `av.Packet`s without pickling. An earlier process pool
paid a copy of every frame into /dev/shm, the children's start and a pickled round trip of every packet.

Bounds: one pool per process, as many threads as the largest segment count asked for (at most the cores);
runs are submitted per video, their packets stay in memory until the muxer takes them (at most one video's
compressed size), and a run's packets are muxed as soon as it and every run before it are done.

Streaming (`SegmentStream`): the runs' bounds depend only on the frame count and the run count, so a video
whose frames arrive in order (the fleet's streamed hand-off, `runners.common.handoff.FrameStream`) starts
each run as soon as its last frame is in (`advance`), while the rest is still being decoded; the runs are
the same runs on the same frames, so the packets, and the file, are those of the one-shot encode. The pool
is FIFO: a video's runs queue behind the previous video's. `abort()` cancels the runs not started (a run
already encoding finishes on its own and is dropped), so a failed render leaves nothing waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["Run", "SegmentStream", "encode_segments", "segment_bounds"]

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < size:
            if _pool is not None:  # (its running runs finish; new ones go to the larger pool)
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="x264-segment")
            _pool_size = size
        return _pool


def segment_bounds(frames: int, segments: int) -> list[int]:
    """Frame indices where the runs start, plus `frames` at the end (runs differ by at most one frame)."""
    segments = max(1, min(int(segments), int(frames)))
    return [round(i * frames / segments) for i in range(segments + 1)]


class Run:
    """One encoded run: its packets in decode order (time base 1 / rate), its encoder's SPS/PPS, and when it
    started and ended (`time.monotonic()`, the host's clock)."""

    def __init__(self, packets: list[Any], extradata: bytes | None, started: float = 0.0, ended: float = 0.0) -> None:
        self.packets, self.extradata = packets, extradata
        self.started, self.ended = started, ended


class SegmentStream:
    """The runs of one video, each started when its frames are in (see the module docstring).

    `frames` (F, H * 3 // 2, W) uint8 yuv420p may still be filling: only frames below what `advance(ready)`
    announced are read. `runs()` yields the `Run`s in order once every frame is announced."""

    def __init__(
        self, frames: np.ndarray, width: int, height: int, rate: Fraction, settings: dict[str, Any], segments: int
    ) -> None:
        self.frames, self.width, self.height, self.rate, self.settings = frames, width, height, rate, settings
        self.bounds = segment_bounds(len(frames), segments)
        self.ready = 0
        self.aborted = False
        self._lock = threading.Lock()
        self._jobs: list[Future[Run]] = []

    @property
    def total(self) -> int:
        return len(self.frames)

    def advance(self, ready: int) -> None:
        """Frames [0, ready) are final: start every run that lies within them."""
        with self._lock:
            if self.aborted:
                return
            self.ready = max(self.ready, min(int(ready), self.total))
            pool = _executor(len(self.bounds) - 1)
            while len(self._jobs) < len(self.bounds) - 1 and self.bounds[len(self._jobs) + 1] <= self.ready:
                k = len(self._jobs)
                self._jobs.append(
                    pool.submit(
                        _encode_run,
                        self.frames,
                        self.bounds[k],
                        self.bounds[k + 1],
                        self.width,
                        self.height,
                        self.rate,
                        self.settings,
                    )
                )

    def runs(self) -> Iterator[Run]:
        """Each run in order as soon as it and the runs before it are encoded (every frame must be in).
        Closing the iterator early (an error in the caller) cancels the runs not started yet."""
        if self.ready < self.total or self.aborted:
            raise RuntimeError(f"segment stream: {self.ready} of {self.total} frames arrived (aborted: {self.aborted})")
        try:
            for job in list(self._jobs):
                yield job.result()
        finally:
            for job in self._jobs:
                job.cancel()

    def abort(self) -> None:
        """The video will not be written: cancel the runs not started (running ones end on their own)."""
        with self._lock:
            self.aborted = True
            for job in self._jobs:
                job.cancel()

    def jobs(self) -> list[Future[Run]]:
        with self._lock:
            return list(self._jobs)

    def pending(self) -> int:
        """Runs submitted and neither finished nor cancelled."""
        with self._lock:
            return sum(not job.done() for job in self._jobs)


def encode_segments(
    frames: np.ndarray, width: int, height: int, rate: Fraction, settings: dict[str, Any], segments: int
) -> Iterator[Run]:
    """yuv420p `frames` (F, H * 3 // 2, W) uint8 -> one `Run` per segment, in order, each as soon as it and
    the runs before it are encoded. `settings`: `options` (x264's) and `threads` (frame threads per run).
    Closing the iterator early (an error in the caller) cancels the runs not started yet."""
    stream = SegmentStream(frames, width, height, rate, settings, segments)
    stream.advance(len(frames))
    yield from stream.runs()


def _encode_run(
    frames: np.ndarray, lo: int, hi: int, width: int, height: int, rate: Fraction, settings: dict[str, Any]
) -> Run:
    """Frames [lo, hi) through one x264 whose headers are out of band, as the mp4 stream's encoder's are."""
    import av
    from av.codec.context import Flags

    started = time.monotonic()
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    ctx.framerate = rate
    ctx.time_base = 1 / rate
    ctx.flags |= int(Flags.global_header)
    ctx.thread_type, ctx.thread_count = "FRAME", int(settings["threads"])
    ctx.options = dict(settings["options"])
    packets: list[Any] = []
    for i in range(lo, hi):
        frame = av.VideoFrame.from_ndarray(frames[i], format="yuv420p")
        frame.pts, frame.time_base = i, ctx.time_base
        packets.extend(ctx.encode(frame))
    packets.extend(ctx.encode(None))
    for packet in packets:
        packet.time_base = ctx.time_base
    return Run(packets, bytes(ctx.extradata) if ctx.extradata else None, started, time.monotonic())
