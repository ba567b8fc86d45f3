"""Conditioning images in: decoded with PyAV and torch only (no pillow or torchvision needed).

Images arrive in the job kwargs as base64-encoded PNG, JPEG, WebP, GIF or BMP files, so a request is
self-contained and never names a path on the worker. The request check (`ltx_contract.schema`, at the producer and
in the worker) and this decoder read the same container parser (`ltx_mgpu.spec.image_size`): other formats, sizes
over 4096 pixels per side and containers whose parts disagree are refused before FFmpeg opens the file (it
decodes while it probes); the codec FFmpeg detects must be one of the five, and the decoded picture must be
the size the container declared. Decoding runs on every rank from
the same bytes, so a bad image raises the same `ValueError` everywhere (a recoverable, symmetric failure).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import torch

from ...spec.image_size import IMAGE_FORMATS, MAX_IMAGE_SIDE, image_size

__all__ = ["DecodedImage", "decode_image", "parse_images", "to_model_input"]

MAX_IMAGE_BYTES = 16 << 20
#: FFmpeg decoders of the formats the request check can size from the header (PNG, JPEG, WebP, GIF, BMP)
IMAGE_CODECS = frozenset({"png", "mjpeg", "webp", "gif", "bmp"})


@dataclass(frozen=True)
class DecodedImage:
    """A request's conditioning image after decoding: uint8 pixels (H, W, 3), the video frame it pins, its
    strength. (The request schema's `ConditioningImage` is the same image still as a base64 file.)"""

    pixels: torch.Tensor
    frame: int
    strength: float


def decode_image(data: bytes) -> torch.Tensor:
    """uint8 (H, W, 3) RGB pixels of the first picture in `data`; `ValueError` if it is not an image, if its
    container declares more than the budget or contradicts itself (`ltx_mgpu.spec.image_size`, read before FFmpeg
    sees a byte: FFmpeg decodes while it probes), or if the decoded picture is not the size declared."""
    import av

    declared = image_size(data)  # (ImageRefused is a ValueError)
    if declared is None:
        raise ValueError(f"not a {IMAGE_FORMATS} file (the formats whose size is checked before decoding)")
    name, width, height = declared
    if max(width, height) > MAX_IMAGE_SIDE:
        raise ValueError(f"{name} image of {width}x{height} pixels; at most {MAX_IMAGE_SIDE} per side")
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("no picture stream")
            stream = container.streams.video[0]
            codec = stream.codec_context.name
            if codec not in IMAGE_CODECS:
                raise ValueError(f"{codec} images are not accepted (PNG, JPEG, WebP, GIF or BMP only)")
            for frame in container.decode(video=0):
                if (frame.width, frame.height) != (width, height):
                    raise ValueError(
                        f"the {name} header declares {width}x{height} pixels, the picture decoded "
                        f"to {frame.width}x{frame.height}"
                    )
                return torch.from_numpy(frame.to_ndarray(format="rgb24")).contiguous()
    except (av.FFmpegError, OSError) as exc:  # FFmpeg's errors are OSError subclasses too
        raise ValueError(f"cannot decode the conditioning image: {exc}") from exc
    raise ValueError("cannot decode the conditioning image: no frames")


def parse_images(images: Any, num_frames: int) -> list[DecodedImage]:
    """Validate and decode the `images` job kwarg: a list of {"data": base64, "frame": int, "strength": float}."""
    if images is None:
        return []
    if not isinstance(images, list | tuple):
        raise ValueError("images must be a list of {'data', 'frame', 'strength'} objects")
    out = []
    for i, item in enumerate(images):
        if not isinstance(item, dict) or "data" not in item:
            raise ValueError(f"images[{i}] must be an object with a base64 'data' field")
        frame = int(item.get("frame", 0))
        strength = float(item.get("strength", 1.0))
        if not 0 <= frame < num_frames:
            raise ValueError(f"images[{i}].frame must be in [0, {num_frames - 1}], got {frame}")
        if frame and frame % 8:
            raise ValueError(f"images[{i}].frame must be 0 or a multiple of 8 (a latent frame), got {frame}")
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"images[{i}].strength must be in [0, 1], got {strength}")
        try:
            raw = base64.b64decode(item["data"], validate=True)
        except (binascii.Error, TypeError) as exc:
            raise ValueError(f"images[{i}].data is not valid base64: {exc}") from exc
        if len(raw) > MAX_IMAGE_BYTES:
            raise ValueError(f"images[{i}] is {len(raw)} bytes, over the {MAX_IMAGE_BYTES} byte limit")
        out.append(DecodedImage(decode_image(raw), frame, strength))
    return out


def to_model_input(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (H, W, 3) -> float32 (1, 3, 1, height, width) in [-1, 1]: scaled to cover the target, then
    centre-cropped (aspect ratio kept), as the VAE encoder expects a one-frame video."""
    img = pixels.permute(2, 0, 1).float()[None] / 255.0
    h, w = img.shape[-2:]
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    img = torch.nn.functional.interpolate(img, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
    top, left = (nh - height) // 2, (nw - width) // 2
    img = img[..., top : top + height, left : left + width].clamp(0.0, 1.0)
    return (img * 2.0 - 1.0)[:, :, None]
