"""mp4 back in, with PyAV: the frames and frame rate (`read_mp4`), the audio (`read_audio`) and what a player would
decode (`probe_mp4`: codecs, frames, samples). What the tests and examples check a written video
with; the writing side is `mp4`, which renders and the worker's encoder use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Mp4Streams", "probe_mp4", "read_audio", "read_mp4"]


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
