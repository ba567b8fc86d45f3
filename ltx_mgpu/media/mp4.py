"""mp4 out (H.264 video + optional AAC stereo audio), with PyAV; reading one back is `mp4_read`. Used on the
driver rank (or by the worker's encoder, beside the next job).

`write_mp4(frames, path, fps, audio=AudioTrack(...))` muxes what LTX-2 renders: uint8 frames as H.264
(yuv420p) at the frame rate, and the vocoder's waveform as AAC at the vocoder's own sample rate, stereo.
Samples reach the encoder through an `AudioResampler` that converts them to the encoder's sample format and
layout (AAC wants planar float, 1024-sample frames); the resampler and both encoders are flushed at the end,
so no tail of either stream is lost. The file is written under a temporary name and renamed, so a reader
never sees half a video.

AAC adds an encoder delay ("priming", 1024 samples here) that the mp4 records in its edit list; a decoder
that honours it (FFmpeg, PyAV, browsers) returns the input's samples padded up to a whole AAC frame.

The fast path: RGB becomes yuv420p with torch ops on the device that decoded it
(`rgb_to_yuv420p`: BT.601 limited range, 2x2 chroma averaging: what swscale's default rgb24 -> yuv420p did
for untagged input, and the stream is tagged BT.601 so players do not guess BT.709 for HD sizes), so half
the bytes cross to the host and no swscale runs; x264 then encodes runs of frames in parallel on every
core, joined by the muxer (`EncodeOptions`, `x264_segments`), by default with `tune=fastdecode` and no
B-frames: 3.4x less CPU than `veryfast` alone on noise at the same PSNR, for +16% bytes there and +52% on
a smooth clip (docs/performance.md, "The mp4 encode"). `media_event` hands the converted frames and the
audio off to whoever encodes them (the worker, beside the next job); `write_mp4` keeps the runner-side path
for controller users.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..control.events import MEDIA

__all__ = [
    "MEDIA",
    "AudioTrack",
    "EncodeOptions",
    "audio_fields",
    "frame_rate_fraction",
    "media_event",
    "page_lock",
    "rgb_to_yuv420p",
    "shared_empty",
    "shared_host_copy",
    "to_yuv420p",
    "usable_cores",
    "write_mp4",
    "write_mp4_yuv",
]

AAC_BITRATE = 192_000  #: stereo AAC-LC at 192 kb/s: transparent for generated audio
_CONVERT_CHUNK = 16  #: frames converted at once (bounds the int32 working set: ~300 MB at 1536x1024)
_MIN_SEGMENT_FRAMES = 16  #: shorter runs spend too much on their IDR frame (and a 9-frame test clip stays whole)
#: x264 VUI: BT.601 (smpte170m) primaries, transfer and matrix, limited range, matching the conversion
_X264_COLOUR = "colorprim=smpte170m:transfer=smpte170m:colormatrix=smpte170m:range=tv"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's cpuset, `taskset`), not the host's
    count, so an encoder limited to 2 of 16 cores starts 2 x264 threads, not 16."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class EncodeOptions:
    """H.264 settings: `crf` (quality, 0 = lossless), `preset` (x264 speed/size trade-off), `tune` (an x264
    tune or ""), `threads` (cores the encode may use; 0 = every core this process may run on, `usable_cores()`: 16
    on the GPU hosts, 2 in CI) and `segments`: the video is cut into that many runs of frames, each encoded
    by its own x264 in a thread (`x264_segments`) on `threads // segments` frame threads, the packets joined
    by the muxer. 0 (the default) = as many runs as threads, each at least `_MIN_SEGMENT_FRAMES` long; 1 =
    one x264 with frame threads on every core."""

    crf: int = 18
    preset: str = "veryfast"
    tune: str = "fastdecode"
    bframes: int = 0
    threads: int = 0
    segments: int = 0

    @property
    def thread_count(self) -> int:
        return int(self.threads) if int(self.threads) > 0 else usable_cores()

    def segment_count(self, frames: int) -> int:
        wanted = int(self.segments) if int(self.segments) > 0 else self.thread_count
        return max(1, min(wanted, frames // _MIN_SEGMENT_FRAMES))

    def threads_per_segment(self, segments: int) -> int:
        return max(1, self.thread_count // max(1, segments))


@dataclass(frozen=True)
class AudioTrack:
    """A waveform to mux: float (channels, samples) in [-1, 1] at `sample_rate` Hz (1 or 2 channels)."""

    waveform: torch.Tensor
    sample_rate: int

    def __post_init__(self) -> None:
        w = self.waveform
        if w.dim() != 2 or w.shape[0] not in (1, 2) or not w.is_floating_point():
            raise ValueError(
                f"audio waveform must be float (channels in 1..2, samples), got {w.dtype} {tuple(w.shape)}"
            )
        if int(self.sample_rate) <= 0:
            raise ValueError(f"audio sample_rate must be positive, got {self.sample_rate}")

    @property
    def duration_s(self) -> float:
        return float(self.waveform.shape[1]) / float(self.sample_rate)

    def fitted(self, duration_s: float) -> AudioTrack:
        """The same track trimmed or padded with silence to `duration_s` (rounded to whole samples), so
        the audio ends with the video instead of a few milliseconds early or late."""
        target = max(1, round(duration_s * self.sample_rate))
        w = self.waveform[:, :target]
        if w.shape[1] < target:
            w = torch.nn.functional.pad(w, (0, target - w.shape[1]))
        return AudioTrack(w.contiguous(), int(self.sample_rate))


def audio_fields(track: AudioTrack | None) -> dict[str, object]:
    """The `output` event's audio fields: `audio` (bool), `audio_sample_rate` (Hz) and `audio_duration_s`
    (None when the file is silent)."""
    if track is None:
        return {"audio": False, "audio_sample_rate": None, "audio_duration_s": None}
    return {"audio": True, "audio_sample_rate": int(track.sample_rate), "audio_duration_s": round(track.duration_s, 6)}


def frame_rate_fraction(fps: float) -> Fraction:
    """The stream time base of `fps` (29.97 -> 30000/1001): what the muxer and the segment runs share."""
    return Fraction(fps).limit_denominator(1001)


def rgb_to_yuv420p(frames: torch.Tensor) -> torch.Tensor:
    """uint8 RGB frames (F, H, W, 3) -> uint8 yuv420p frames (F, H * 3 // 2, W) on the same device: each
    frame's Y plane (H rows) then U and V (H/2 x W/2 each, packed into H/2 more rows of W), the layout
    `av.VideoFrame.from_ndarray(format="yuv420p")` takes. H and W must be even."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    n, height, width = int(frames.shape[0]), int(frames.shape[1]), int(frames.shape[2])
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs an even width and height, got {width}x{height}")
    out = torch.empty((n, height * 3 // 2, width), dtype=torch.uint8, device=frames.device)
    quarter = height * width // 4
    for i in range(0, n, _CONVERT_CHUNK):
        # BT.601 limited range in 8-bit fixed point (Y = 16 + (66 R + 129 G + 25 B + 128) >> 8, the integer
        # form of 0.2568 R + 0.5041 G + 0.0979 B): integer ops, fast on CPU ranks as well as on the device
        planes = frames[i : i + _CONVERT_CHUNK].permute(3, 0, 1, 2).to(torch.int32)  # (3, f, H, W), contiguous
        f = int(planes.shape[1])
        r, g, b = planes
        block = out[i : i + f].view(f, -1)
        block[:, : height * width] = (((66 * r + 129 * g + 25 * b + 128) >> 8) + 16).reshape(f, -1).to(torch.uint8)
        # chroma of the 2x2 sum (the conversion is linear: the same as averaging the four chroma samples)
        sums = planes[..., 0::2, 0::2] + planes[..., 0::2, 1::2] + planes[..., 1::2, 0::2] + planes[..., 1::2, 1::2]
        rs, gs, bs = sums
        u = ((-38 * rs - 74 * gs + 112 * bs + 512) >> 10) + 128
        v = ((112 * rs - 94 * gs - 18 * bs + 512) >> 10) + 128
        block[:, height * width :] = torch.stack([u, v], 1).reshape(f, 2 * quarter).to(torch.uint8)
    return out


def to_yuv420p(frames: torch.Tensor) -> torch.Tensor:
    """`rgb_to_yuv420p` where the frames are: on a GPU with torch ops; on the CPU with swscale (SIMD on
    bytes: 121 frames at 768x512 took 10-15 s as torch ops on a busy 2-core VM), the same BT.601 limited
    matrix, its own chroma filter (equal to ours within one code value on smooth pictures)."""
    if frames.device.type != "cpu":
        return rgb_to_yuv420p(frames)
    import av

    rgb_to_yuv420p(frames[:0])  # the same checks (dtype, shape, even sizes) on no frames
    planes = [
        av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray()
        for f in frames.contiguous().numpy()
    ]
    return torch.from_numpy(np.stack(planes)) if planes else torch.empty((0, *_yuv_shape(frames)), dtype=torch.uint8)


def _yuv_shape(frames: torch.Tensor) -> tuple[int, int]:
    return int(frames.shape[1]) * 3 // 2, int(frames.shape[2])


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor in shared memory: the controller's pipe carries only its handle."""
    try:
        storage = torch.UntypedStorage._new_shared(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
        return torch.empty(0, dtype=dtype).set_(storage).view(shape)
    except (AttributeError, RuntimeError):  # (a torch without the private allocator: one extra copy)
        return torch.empty(shape, dtype=dtype).share_memory_()


def shared_host_copy(tensor: torch.Tensor, *, pinned: bool = True) -> torch.Tensor:
    """`tensor` copied into a fresh CPU tensor in shared memory, so the controller's pipe carries only its
    handle (a yielded tensor not yet shared would be copied into shared memory once more on the way).

    From a GPU with `pinned`, the shared pages are page-locked (`cudaHostRegister`) for the copy, so it is one
    DMA straight into them instead of the driver's pageable path (its own staging buffer, then a CPU copy
    of every byte, faulting the fresh pages one at a time); they are unlocked after it. Where registering
    fails (a limit, an old driver) the copy is the pageable one."""
    host = shared_empty(tuple(tensor.shape), tensor.dtype)
    nbytes = host.numel() * host.element_size()
    if not (pinned and tensor.device.type == "cuda" and nbytes and page_lock(host, nbytes)):
        host.copy_(tensor)
        return host
    try:
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    return host


def page_lock(host: torch.Tensor, nbytes: int) -> bool:
    """Page-lock `nbytes` of a host tensor for DMA copies (True), or leave it pageable where CUDA refuses
    (False); the caller unlocks with `cudaHostUnregister`."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 1)) == 0  # (1: portable, any context)
    except (AttributeError, RuntimeError):
        return False


def media_event(
    yuv: torch.Tensor, *, width: int, height: int, fps: float, audio: AudioTrack | None
) -> dict[str, object]:
    """The hand-off event: yuv420p frames (F, H * 3 // 2, W, in shared memory) and the audio waveform for
    an encoder outside the fleet (`write_mp4_yuv`). Its tensors travel to the controller without pickling."""
    return {
        "type": MEDIA,
        "video": yuv,
        "width": int(width),
        "height": int(height),
        "fps": float(fps),
        "frames": int(yuv.shape[0]),
        "audio": None if audio is None else shared_host_copy(audio.waveform.detach().float()),
        "audio_sample_rate": None if audio is None else int(audio.sample_rate),
    }


def write_mp4(
    frames: torch.Tensor,
    path: str | Path,
    fps: float,
    *,
    crf: int = 18,
    audio: AudioTrack | None = None,
    options: EncodeOptions | None = None,
) -> int:
    """Encode uint8 frames (F, H, W, 3, on any device: converted to yuv420p there) as H.264, plus `audio` as
    AAC stereo, into `path`; return the file size in bytes. `options` (default: `crf` and the defaults of
    `EncodeOptions`) set the encoder."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    yuv = to_yuv420p(frames).cpu()
    return write_mp4_yuv(yuv, path, fps, width=int(frames.shape[2]), audio=audio, options=options or EncodeOptions(crf))


def write_mp4_yuv(
    yuv: torch.Tensor,
    path: str | Path,
    fps: float,
    *,
    width: int,
    audio: AudioTrack | None = None,
    options: EncodeOptions | None = None,
    stream: Any = None,
) -> int:
    """Encode yuv420p frames (F, H * 3 // 2, W) uint8 on the CPU (`rgb_to_yuv420p`) as H.264 with x264
    frame threads, plus `audio` as AAC stereo, into `path` (written under a temporary name, then renamed);
    return the file size in bytes. `stream`: the runs of these frames already started as they arrived
    (`mp4_stream.segment_stream`, the same runs this call would start)."""
    import av

    options = options or EncodeOptions()
    if yuv.dtype != torch.uint8 or yuv.dim() != 3 or yuv.shape[2] != width or (yuv.shape[1] * 2) % 3:
        raise ValueError(f"expected uint8 yuv420p frames (F, H*3/2, {width}), got {yuv.dtype} {tuple(yuv.shape)}")
    height = int(yuv.shape[1]) * 2 // 3
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    segments = options.segment_count(int(yuv.shape[0]))
    frames = yuv.contiguous().numpy()
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            video = container.add_stream("libx264", rate=frame_rate_fraction(fps))
            _configure(video.codec_context, int(width), height, options, options.threads_per_segment(segments))
            sound = None
            if audio is not None:
                sound = container.add_stream("aac", rate=int(audio.sample_rate), layout="stereo")
                sound.bit_rate = AAC_BITRATE
            if segments == 1:
                for frame in frames:
                    container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="yuv420p")))
                container.mux(video.encode())
            else:  # the stream's own encoder (same settings: the same SPS/PPS) only writes the header
                _mux_segments(container, video, frames, options, segments, frame_rate_fraction(fps), stream)
            if sound is not None and audio is not None:
                _encode_audio(container, sound, audio)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _mux_segments(
    container: Any,
    video: Any,
    frames: np.ndarray,
    options: EncodeOptions,
    segments: int,
    rate: Fraction,
    stream: Any = None,
) -> None:
    """Parallel x264 runs (`x264_segments`) muxed in order as each finishes; every run's SPS/PPS must be the
    header's byte for byte (a decoder uses the header's for every frame), else the file is not written."""
    from .x264_segments import encode_segments

    container.start_encoding()  # opens the stream's encoder: its extradata is what the header carries
    header = bytes(video.codec_context.extradata or b"")
    settings = segment_settings(options, segments)
    runs = (
        stream.runs()
        if stream is not None
        else encode_segments(frames, video.codec_context.width, video.codec_context.height, rate, settings, segments)
    )
    for k, run in enumerate(runs):
        if run.extradata != header:
            raise RuntimeError(f"x264 segment {k}: its SPS/PPS differ from the stream header's; not joined")
        for packet in run.packets:
            packet.stream = video
            container.mux(packet)


def segment_settings(options: EncodeOptions, segments: int) -> dict[str, Any]:
    """What each x264 run of a `segments`-run encode gets (`x264_segments`)."""
    return {"options": _x264_options(options), "threads": options.threads_per_segment(segments)}


def _configure(ctx: object, width: int, height: int, options: EncodeOptions, threads: int) -> None:
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"  # type: ignore[attr-defined]
    ctx.thread_type, ctx.thread_count = "FRAME", threads  # type: ignore[attr-defined]
    ctx.options = _x264_options(options)  # type: ignore[attr-defined]


def _x264_options(options: EncodeOptions) -> dict[str, str]:
    tune = {"tune": options.tune} if options.tune else {}
    bframes = f":bframes={int(options.bframes)}" if int(options.bframes) >= 0 else ""
    return {"crf": str(options.crf), "preset": options.preset, **tune, "x264-params": _X264_COLOUR + bframes}


def _encode_audio(container: object, stream: object, audio: AudioTrack) -> None:
    """Waveform -> encoder format (resampler, flushed) -> AAC packets (encoder, flushed)."""
    import av

    wave = audio.waveform.detach().to(device="cpu", dtype=torch.float32).clamp(-1.0, 1.0)
    if wave.shape[0] == 1:  # a mono track still becomes a stereo stream
        wave = wave.expand(2, -1)
    source = av.AudioFrame.from_ndarray(wave.contiguous().numpy(), format="fltp", layout="stereo")
    source.sample_rate = int(audio.sample_rate)
    source.pts = 0
    source.time_base = Fraction(1, int(audio.sample_rate))
    resampler = av.AudioResampler(format=stream.format, layout=stream.layout, rate=int(audio.sample_rate))
    for frame in [*resampler.resample(source), *resampler.resample(None)]:
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))
