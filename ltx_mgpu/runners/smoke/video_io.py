"""mp4 encoding (and reading back, for tests) with PyAV. Used on the driver rank only."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import torch

__all__ = ["read_mp4", "write_mp4"]


def _rate(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(1001)


def write_mp4(frames: torch.Tensor, path: str | Path, fps: float, *, crf: int = 18) -> int:
    """Encode uint8 frames (F, H, W, 3) as H.264 (yuv420p) into `path`; return the file size in bytes.

    Written to a temporary name and renamed, so a reader never sees a half-written file.
    """
    import av

    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    height, width = int(frames.shape[1]), int(frames.shape[2])
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=_rate(fps))
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": str(crf), "preset": "veryfast"}
            for frame in frames.numpy():
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_mp4(path: str | Path) -> tuple[torch.Tensor, float]:
    """Decode an mp4 back to uint8 frames (F, H, W, 3) and its average frame rate."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate) if stream.average_rate else 0.0
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
    return torch.stack(frames), fps
