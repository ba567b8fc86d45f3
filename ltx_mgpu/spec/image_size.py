"""An image file's pixel size read from its container, without decoding it (standard library only).

Why: a conditioning image is decoded on every rank of the fleet; a 0.75 MB PNG declaring 16000x16000
pixels decoded to a 0.77 GB tensor per rank before anything looked at its size. The request check
(`ltx_contract.schema`, run by the producer and again by the worker) and the runner's decoder
(`runners/ltx2/images.py`, before FFmpeg opens the file) both call `image_size` here and refuse an image
over `MAX_IMAGE_SIDE`, and every format this parser cannot read (the FFmpeg decoder would take TIFF, EXR,
JPEG 2000, ... unchecked).

A header that lies is refused too (docs/security.md): a check of the first header only would pass a 9.8 KB WebP
with a 16x16 VP8X canvas around a 16000x16000 VP8L bitstream (FFmpeg decodes it: +980 MB), a JPEG with a
decoy 16x16 SOF0 before the real one, and a GIF with a 16x16 screen around an 8000x8000 frame. So
every part that declares a size is read and checked against the canvas before any decoder runs:
- PNG: the IHDR (first chunk), and every APNG frame (`fcTL`) inside it;
- JPEG: every segment up to the end of the file, entropy-coded data included: exactly one frame header
  (SOF), of a non-zero size (a decoy SOF, a second image after EOI or a height left to a DNL marker is refused);
- GIF: the logical screen and every image descriptor, which must lie inside it;
- WebP: the VP8X canvas (if any) and every VP8/VP8L bitstream, plain or inside animation frames (`ANMF`):
  a still image's bitstream must be the canvas' size, an animation frame's its frame's, inside the canvas;
- BMP: the header (both the 40-byte and the OS/2 12-byte kinds).
The pixel budget: at most `MAX_IMAGE_SIDE` per side, and `MAX_DECLARED_PIXELS` over every frame a file
declares (an animation of many frames is refused before its first is decoded). The runner checks that the
decoded picture is the size declared here.

Every walk is bounded by the file's length (each step advances), the files by `MAX_IMAGE_BYTES` upstream.
Stdlib only: the producer imports it (through `ltx_contract.schema`), as it does `ltx_mgpu.spec.bounds`.
"""

from __future__ import annotations

import re

from ltx_mgpu.errors import LtxMgpuError

__all__ = ["IMAGE_FORMATS", "MAX_DECLARED_PIXELS", "MAX_IMAGE_SIDE", "ImageRefused", "image_size"]

IMAGE_FORMATS = "PNG, JPEG, WebP, GIF or BMP"  #: the formats accepted (for messages)

MAX_IMAGE_SIDE = 4096  #: pixels per side of a conditioning image (the video is at most 2048 per side)
MAX_DECLARED_PIXELS = 4 * MAX_IMAGE_SIDE * MAX_IMAGE_SIDE  #: summed over every frame a file declares

_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT/JPG/DAC)
_JPEG_NEXT_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")  # in entropy-coded data: not stuffing/RSTn


class ImageRefused(LtxMgpuError, ValueError):
    """The file is one of the accepted formats but its container contradicts itself or declares too much."""


def image_size(raw: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) of the picture a PNG, JPEG, WebP, GIF or BMP file holds, every part of the
    container checked (module docstring); None for any other format or a header too short to say.
    Raises `ImageRefused` for a container whose parts disagree or that declares more than the budget."""
    if raw.startswith(_PNG) and raw[12:16] == b"IHDR" and len(raw) >= 24:
        found = _png(raw)
    elif raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 13:
        found = _gif(raw)
    elif raw[:2] == b"BM" and len(raw) >= 26:
        found = _bmp(raw)
    elif raw[:4] == b"RIFF" and raw[8:12] == b"WEBP" and len(raw) >= 30:
        found = _webp(raw)
    elif raw[:2] == b"\xff\xd8":
        found = _jpeg(raw)
    else:
        return None
    if found is None:
        return None
    name, width, height, frames = found
    if width < 1 or height < 1:
        raise ImageRefused(f"{name} declares a {width}x{height} picture")
    if max(width, height) <= MAX_IMAGE_SIDE and sum(w * h for w, h in frames) > MAX_DECLARED_PIXELS:
        raise ImageRefused(
            f"{name} declares {len(frames)} frames of {sum(w * h for w, h in frames)} pixels in all; "
            f"at most {MAX_DECLARED_PIXELS}"
        )
    return name, width, height


# Each reader returns (format, width, height, [(w, h) of every frame it declares]) or None.
_Found = tuple[str, int, int, list[tuple[int, int]]]


def _png(raw: bytes) -> _Found:
    width, height = _be(raw[16:20]), _be(raw[20:24])
    frames = [(width, height)]
    i = 8 + 8 + 13 + 4  # signature, IHDR's length and type, its data, its CRC
    while i + 8 <= len(raw):
        length, kind = _be(raw[i : i + 4]), raw[i + 4 : i + 8]
        data = raw[i + 8 : i + 8 + length]
        if kind == b"IHDR":
            raise ImageRefused("PNG with a second IHDR chunk")
        if kind == b"fcTL" and len(data) >= 20:  # an APNG frame: inside the canvas
            w, h, x, y = _be(data[4:8]), _be(data[8:12]), _be(data[12:16]), _be(data[16:20])
            _inside("PNG", "frame", (w, h, x, y), width, height)
            frames.append((w, h))
        if kind == b"IEND":
            break
        i += 12 + length
    return "PNG", width, height, frames


def _gif(raw: bytes) -> _Found:
    width, height, packed = _le(raw[6:8]), _le(raw[8:10]), raw[10]
    frames: list[tuple[int, int]] = []
    i = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)  # the global colour table
    while i < len(raw):
        block = raw[i]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then sub-blocks
            i = _gif_sub_blocks(raw, i + 2)
        elif block == 0x2C:  # image descriptor
            if i + 10 > len(raw):
                break
            x, y, w, h, flags = (
                _le(raw[i + 1 : i + 3]),
                _le(raw[i + 3 : i + 5]),
                _le(raw[i + 5 : i + 7]),
                _le(raw[i + 7 : i + 9]),
                raw[i + 9],
            )
            _inside("GIF", "frame", (w, h, x, y), width, height)
            frames.append((w, h))
            i += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # the local colour table
            i = _gif_sub_blocks(raw, i + 1)  # (after the LZW code size byte)
        else:
            raise ImageRefused(f"GIF with an unknown block 0x{block:02x} at byte {i}")
    return "GIF", width, height, frames or [(width, height)]


def _gif_sub_blocks(raw: bytes, i: int) -> int:
    while i < len(raw) and raw[i]:
        i += 1 + raw[i]
    return i + 1


def _bmp(raw: bytes) -> _Found:
    if _le(raw[14:18]) == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
        width, height = _le(raw[18:20]), _le(raw[20:22])
    else:
        width, height = abs(_le(raw[18:22], signed=True)), abs(_le(raw[22:26], signed=True))
    return "BMP", width, height, [(width, height)]


def _webp(raw: bytes) -> _Found | None:
    chunks = list(_riff_chunks(raw, 12, len(raw)))
    if not chunks:
        return None
    first, data = chunks[0]
    if first in (b"VP8 ", b"VP8L"):
        size = _webp_bitstream(first, data)
        return None if size is None else ("WebP", *size, [size])
    if first != b"VP8X" or len(data) < 10:
        return None
    width, height = _le(data[4:7]) + 1, _le(data[7:10]) + 1
    frames = []
    for kind, body in chunks[1:]:
        if kind in (b"VP8 ", b"VP8L"):  # a still image: the bitstream is the canvas
            size = _webp_bitstream(kind, body)
            if size != (width, height):
                raise ImageRefused(f"WebP canvas of {width}x{height} around a {_dims(size)} bitstream")
            frames.append(size)
        elif kind == b"ANMF" and len(body) >= 16:
            x, y, w, h = 2 * _le(body[0:3]), 2 * _le(body[3:6]), _le(body[6:9]) + 1, _le(body[9:12]) + 1
            _inside("WebP", "animation frame", (w, h, x, y), width, height)
            for inner, frame_data in _riff_chunks(body, 16, len(body)):
                if inner in (b"VP8 ", b"VP8L") and _webp_bitstream(inner, frame_data) != (w, h):
                    size = _webp_bitstream(inner, frame_data)
                    raise ImageRefused(f"WebP animation frame of {w}x{h} holding a {_dims(size)} bitstream")
            frames.append((w, h))
    return "WebP", width, height, frames or [(width, height)]


def _riff_chunks(raw: bytes, start: int, end: int) -> list[tuple[bytes, bytes]]:
    out = []
    i = start
    while i + 8 <= end:
        size = _le(raw[i + 4 : i + 8])
        out.append((raw[i : i + 4], raw[i + 8 : min(end, i + 8 + size)]))
        i += 8 + size + (size & 1)  # (chunks are padded to an even size)
    return out


def _webp_bitstream(kind: bytes, data: bytes) -> tuple[int, int] | None:
    """The size a VP8 (lossy key frame) or VP8L (lossless) bitstream declares."""
    if kind == b"VP8 " and len(data) >= 10:
        return _le(data[6:8]) & 0x3FFF, _le(data[8:10]) & 0x3FFF
    if kind == b"VP8L" and len(data) >= 5:
        bits = _le(data[1:5])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _jpeg(raw: bytes) -> _Found | None:
    """Walk every marker of the file (entropy-coded data skipped by searching for the next marker)."""
    sofs: list[tuple[int, int]] = []
    i = 2
    while i + 4 <= len(raw):
        if raw[i] != 0xFF:
            found = _JPEG_NEXT_MARKER.search(raw, i)
            if found is None:
                break
            i = found.start()
            continue
        marker = raw[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x00:  # a stuffed 0xFF of entropy-coded data
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0x01) or 0xD0 <= marker <= 0xD7:  # no length field (SOI, EOI, TEM, RSTn)
            i += 2
            continue
        length = _be(raw[i + 2 : i + 4])
        if marker in _JPEG_SOF and i + 9 <= len(raw):
            sofs.append((_be(raw[i + 7 : i + 9]), _be(raw[i + 5 : i + 7])))
        i += 2 + max(2, length)  # (then, after SOS, the entropy-coded data up to the next marker)
    if not sofs:
        return None
    if len(sofs) > 1:
        raise ImageRefused(
            f"JPEG with {len(sofs)} frame headers ({', '.join(_dims(s) for s in sofs[:4])}); one expected"
        )
    return "JPEG", *sofs[0], sofs


def _inside(name: str, what: str, frame: tuple[int, int, int, int], width: int, height: int) -> None:
    w, h, x, y = frame
    if w < 1 or h < 1 or x + w > width or y + h > height:
        raise ImageRefused(f"{name} {what} of {w}x{h} at ({x}, {y}) outside its {width}x{height} canvas")


def _dims(size: tuple[int, int] | None) -> str:
    return "unreadable" if size is None else f"{size[0]}x{size[1]}"


def _be(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _le(b: bytes, *, signed: bool = False) -> int:
    return int.from_bytes(b, "little", signed=signed)
