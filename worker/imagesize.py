"""An image file's pixel size read from its header, without decoding it (standard library only).

Why: a conditioning image is decoded on every rank of the fleet; a 0.75 MB PNG declaring 16000x16000
pixels decoded to a 0.77 GB tensor per rank before anything looked at its size. The request
check (`worker.schema`, run by the producer and again by the worker) reads the declared size from the
header of the formats below and refuses an image over `MAX_IMAGE_SIDE` before any decoder sees it, and
refuses every other format (its size cannot be read here, and the runner's FFmpeg decoder would take TIFF,
EXR, JPEG 2000, ... unchecked). The runner's decoder keeps the same allow-list on its side
(`ltx_mgpu/runners/ltx2/images.py`).
"""

from __future__ import annotations

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_SIDE", "image_size"]

IMAGE_FORMATS = "PNG, JPEG, WebP, GIF or BMP"  #: the formats accepted (for messages)

MAX_IMAGE_SIDE = 4096  #: pixels per side of a conditioning image (the video is at most 2048 per side)

_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT/JPG/DAC)


def image_size(raw: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) declared by a PNG, JPEG, WebP, GIF or BMP header; None for anything else
    (or a header too short to say)."""
    if raw.startswith(_PNG) and raw[12:16] == b"IHDR" and len(raw) >= 24:
        return "PNG", _be(raw[16:20]), _be(raw[20:24])
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        return "GIF", _le(raw[6:8]), _le(raw[8:10])
    if raw[:2] == b"BM" and len(raw) >= 26:
        return "BMP", abs(_le(raw[18:22], signed=True)), abs(_le(raw[22:26], signed=True))
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP" and len(raw) >= 30:
        return _webp(raw)
    if raw[:2] == b"\xff\xd8":
        return _jpeg(raw)
    return None


def _webp(raw: bytes) -> tuple[str, int, int] | None:
    chunk = raw[12:16]
    if chunk == b"VP8 ":
        return "WebP", _le(raw[26:28]) & 0x3FFF, _le(raw[28:30]) & 0x3FFF
    if chunk == b"VP8L":
        bits = _le(raw[21:25])
        return "WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return "WebP", _le(raw[24:27]) + 1, _le(raw[27:30]) + 1
    return None


def _jpeg(raw: bytes) -> tuple[str, int, int] | None:
    i = 2
    while i + 9 <= len(raw):
        if raw[i] != 0xFF:
            i += 1
            continue
        marker = raw[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length field
            i += 2
            continue
        if marker in _JPEG_SOF:
            return "JPEG", _be(raw[i + 7 : i + 9]), _be(raw[i + 5 : i + 7])
        i += 2 + _be(raw[i + 2 : i + 4])
    return None


def _be(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _le(b: bytes, *, signed: bool = False) -> int:
    return int.from_bytes(b, "little", signed=signed)
