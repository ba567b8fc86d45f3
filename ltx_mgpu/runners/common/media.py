"""mp4 out (H.264 video + optional AAC stereo audio) and back in, with PyAV. Used on the driver rank only.

`write_mp4(frames, path, fps, audio=AudioTrack(...))` muxes what LTX-2 renders: uint8 frames as H.264
(yuv420p) at the frame rate, and the vocoder's waveform as AAC at the vocoder's own sample rate, stereo.
Samples reach the encoder through an `AudioResampler` that converts them to the encoder's sample format and
layout (AAC wants planar float, 1024-sample frames); the resampler and both encoders are flushed at the end,
so no tail of either stream is lost. The file is written under a temporary name and renamed, so a reader
never sees half a video.

AAC adds an encoder delay ("priming", 1024 samples here) that the mp4 records in its edit list; a decoder
that honours it (FFmpeg, PyAV, browsers) returns the input's samples padded up to a whole AAC frame.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

__all__ = ["AudioTrack", "Mp4Streams", "audio_fields", "probe_mp4", "read_audio", "read_mp4", "write_mp4"]

AAC_BITRATE = 192_000  #: stereo AAC-LC at 192 kb/s: transparent for generated audio


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


@dataclass(frozen=True)
class Mp4Streams:
    """What an mp4 holds, as a player sees it (durations in seconds, from the decoded samples/frames)."""

    video_codec: str
    frames: int
    fps: float
    width: int
    height: int
    audio_codec: str | None = None
    audio_sample_rate: int | None = None
    audio_channels: int | None = None
    audio_samples: int | None = None

    @property
    def video_duration_s(self) -> float:
        return self.frames / self.fps if self.fps else 0.0

    @property
    def audio_duration_s(self) -> float | None:
        if self.audio_samples is None or not self.audio_sample_rate:
            return None
        return self.audio_samples / self.audio_sample_rate


def _rate(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(1001)


def write_mp4(
    frames: torch.Tensor, path: str | Path, fps: float, *, crf: int = 18, audio: AudioTrack | None = None
) -> int:
    """Encode uint8 frames (F, H, W, 3) as H.264 (yuv420p), plus `audio` as AAC stereo, into `path`; return
    the file size in bytes."""
    import av

    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    height, width = int(frames.shape[1]), int(frames.shape[2])
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            video = container.add_stream("libx264", rate=_rate(fps))
            video.width, video.height, video.pix_fmt = width, height, "yuv420p"
            video.options = {"crf": str(crf), "preset": "veryfast"}
            sound = None
            if audio is not None:
                sound = container.add_stream("aac", rate=int(audio.sample_rate), layout="stereo")
                sound.bit_rate = AAC_BITRATE
            for frame in frames.numpy():
                container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(video.encode())
            if sound is not None and audio is not None:
                _encode_audio(container, sound, audio)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


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


def read_mp4(path: str | Path) -> tuple[torch.Tensor, float]:
    """Decode an mp4 back to uint8 frames (F, H, W, 3) and its average frame rate."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate) if stream.average_rate else 0.0
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
    return torch.stack(frames), fps


def read_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """Decode the first audio stream to float32 (channels, samples) and its sample rate (`ValueError` if the
    file has none)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path} has no audio stream")
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate)
        to_float = av.AudioResampler(format="fltp", layout=stream.codec_context.layout.name, rate=rate)
        chunks = []
        for frame in container.decode(stream):
            chunks.extend(torch.from_numpy(f.to_ndarray()) for f in to_float.resample(frame))
        chunks.extend(torch.from_numpy(f.to_ndarray()) for f in to_float.resample(None))
    return torch.cat(chunks, dim=1), rate


def probe_mp4(path: str | Path) -> Mp4Streams:
    """Count what a player would decode: video frames and rate, audio codec, rate, channels and samples."""
    import av

    frames, fps = read_mp4(path)
    with av.open(str(path)) as container:
        video_codec = container.streams.video[0].codec_context.name
        audio_info: dict[str, object] = {}
        if container.streams.audio:
            ctx = container.streams.audio[0].codec_context
            audio_info = {"audio_codec": ctx.name, "audio_channels": ctx.channels}
    if audio_info:
        wave, rate = read_audio(path)
        audio_info.update(audio_sample_rate=rate, audio_samples=int(wave.shape[1]))
    return Mp4Streams(
        video_codec=video_codec,
        frames=int(frames.shape[0]),
        fps=fps,
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        **audio_info,  # type: ignore[arg-type]
    )
