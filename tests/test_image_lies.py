"""Images whose header lies (docs/security.md, the review's attacks): real small files made with PyAV, then
patched the way the review's attack files were. Each must be refused by the container parser
(`ltx_mgpu.spec.image_size`), so by the request schema (the producer and the worker) and by the runner's decoder
before FFmpeg opens it.

Before, only the first header was read: a 9.8 KB WebP with a 16x16 VP8X canvas around a 16000x16000 VP8L
bitstream passed and was decoded on a rank (+980 MB), as did a JPEG with a decoy 16x16 SOF0 and a GIF with
a 16x16 screen around an 8000x8000 frame.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import av
import numpy as np
import pytest
from pydantic import ValidationError

from ltx_contract.schema import RenderRequest
from ltx_mgpu.runners.ltx2 import images as runner_images
from ltx_mgpu.spec.image_size import MAX_DECLARED_PIXELS, ImageRefused, image_size
from tests.test_worker_imagesize import _encode


def _webp_lossless(side: int = 16) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="webp") as c:
        s = c.add_stream("libwebp", rate=1, options={"lossless": "1"})
        s.width = s.height = side
        s.pix_fmt = "bgra"
        frame = av.VideoFrame.from_ndarray(np.full((side, side, 3), 90, "uint8"), format="rgb24").reformat(
            format="bgra"
        )
        for p in [*s.encode(frame), *s.encode()]:
            c.mux(p)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return kind + struct.pack("<I", len(data)) + data + (b"\0" if len(data) & 1 else b"")


def _riff(*chunks: bytes) -> bytes:
    body = b"WEBP" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _vp8x(width: int, height: int, flags: int = 0) -> bytes:
    return _chunk(
        b"VP8X", bytes([flags, 0, 0, 0]) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    )


def _vp8l_sized(vp8l: bytes, width: int, height: int) -> bytes:
    """A VP8L chunk's data with its declared size replaced (the bitstream after the header kept)."""
    bits = struct.unpack("<I", vp8l[1:5])[0] & ~((1 << 28) - 1) | (width - 1) | (height - 1) << 14
    return vp8l[:1] + struct.pack("<I", bits) + vp8l[5:]


def _lying_webp() -> bytes:
    real = _webp_lossless()
    assert real[12:16] == b"VP8L"
    vp8l = real[20 : 20 + struct.unpack("<I", real[16:20])[0]]
    return _riff(_vp8x(16, 16), _chunk(b"VP8L", _vp8l_sized(vp8l, 16000, 16000)))


def _jpeg_with_decoy() -> bytes:
    real = _encode("mjpeg", 16, 16, "yuvj420p")
    sof = real.index(b"\xff\xc0")
    big = real[: sof + 5] + struct.pack(">HH", 8000, 8000) + real[sof + 9 :]  # the real SOF, made large
    decoy = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, 16, 16, 1) + b"\x01\x11\x00"
    return big[:2] + decoy + big[2:]


def _gif_with_big_frame() -> bytes:
    real = _encode("gif", 16, 16, "rgb8")
    i = real.index(b"\x2c\x00\x00\x00\x00\x10\x00\x10\x00")  # the image descriptor at (0, 0), 16x16
    return real[: i + 5] + struct.pack("<HH", 8000, 8000) + real[i + 9 :]


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _apng_with_big_frame() -> bytes:
    real = _encode("png", 16, 16)
    fctl = _png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 8000, 8000, 0, 0, 1, 1, 0, 0))
    actl = _png_chunk(b"acTL", struct.pack(">II", 1, 0))
    return real[:33] + actl + fctl + real[33:]


def _gif_of_many_frames(side: int = 4096, frames: int = 5) -> bytes:
    descriptor = b"\x2c" + struct.pack("<HHHH", 0, 0, side, side) + b"\x00" + b"\x02\x00"
    return b"GIF89a" + struct.pack("<HH", side, side) + b"\x00\x00\x00" + descriptor * frames + b"\x3b"


LIES = {
    "webp_canvas": (_lying_webp, "WebP canvas of 16x16 around a 16000x16000 bitstream"),
    "jpeg_decoy_sof": (_jpeg_with_decoy, "JPEG with 2 frame headers (16x16, 8000x8000); one expected"),
    "gif_frame_outside_screen": (_gif_with_big_frame, "GIF frame of 8000x8000 at (0, 0) outside its 16x16 canvas"),
    "apng_frame_outside_canvas": (_apng_with_big_frame, "PNG frame of 8000x8000 at (0, 0) outside its 16x16 canvas"),
    "gif_of_many_big_frames": (_gif_of_many_frames, f"5 frames of {5 * 4096 * 4096} pixels in all; at most "
                                                    f"{MAX_DECLARED_PIXELS}"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LIES))
def test_a_container_that_lies_is_refused_by_the_parser_the_schema_and_the_runner(name, monkeypatch):
    make, says = LIES[name]
    data = make()
    assert len(data) < 10_000
    with pytest.raises(ImageRefused) as info:
        image_size(data)
    assert says in str(info.value)
    with pytest.raises(ValidationError, match="images.0.data"):  # (the producer's and the worker's check)
        RenderRequest(prompt="x", images=[{"data": base64.b64encode(data).decode()}])

    def no_decoding(*_a, **_k):
        raise AssertionError("FFmpeg opened a file the parser should have refused")

    monkeypatch.setattr(av, "open", no_decoding)
    with pytest.raises(ValueError, match="outside|around|frame headers|pixels in all"):
        runner_images.decode_image(data)


@pytest.mark.parametrize(
    ("make", "size"),
    [
        (lambda: _webp_lossless(16), ("WebP", 16, 16)),
        (lambda: _riff(_vp8x(16, 16), _webp_lossless(16)[12:]), ("WebP", 16, 16)),  # an honest VP8X canvas
        (lambda: _encode("mjpeg", 48, 40, "yuvj420p"), ("JPEG", 48, 40)),
        (lambda: _encode("gif", 48, 40, "rgb8"), ("GIF", 48, 40)),
        (lambda: _encode("png", 48, 40), ("PNG", 48, 40)),
    ],
)
def test_honest_files_pass_and_decode_to_the_declared_size(make, size):
    data = make()
    assert image_size(data) == size
    assert tuple(runner_images.decode_image(data).shape) == (size[2], size[1], 3)


def test_the_runner_refuses_a_picture_that_decodes_to_another_size_than_declared(monkeypatch):
    """The last line of defence, if the parser were ever fooled: the decoded picture must be the declared size."""
    data = _encode("png", 48, 40)
    monkeypatch.setattr(runner_images, "image_size", lambda _raw: ("PNG", 16, 16))
    with pytest.raises(ValueError, match="declares 16x16 pixels, the picture decoded to 48x40"):
        runner_images.decode_image(data)


def test_a_bmp_with_the_os2_header_is_sized_from_its_16_bit_fields():
    header = b"BM" + struct.pack("<IHHI", 26 + 16 * 16 * 3, 0, 0, 26) + struct.pack("<IHHHH", 12, 16, 8, 1, 24)
    assert image_size(header + b"\0" * 16 * 8 * 3) == ("BMP", 16, 8)
