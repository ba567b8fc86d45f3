"""`worker.imagesize`: the declared size of real image files of every supported format (encoded with
PyAV/FFmpeg), and the request check that uses it."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from pydantic import ValidationError

from worker.imagesize import MAX_IMAGE_SIDE, image_size
from worker.schema import RenderRequest


def _encode(codec: str, width: int, height: int, pix_fmt: str = "rgb24") -> bytes:
    buf = io.BytesIO()
    fmt = {"libwebp": "webp", "gif": "gif"}.get(codec, "image2pipe")
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=1)
        s.width, s.height, s.pix_fmt = width, height, pix_fmt
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), "uint8"), format="rgb24").reformat(
            format=pix_fmt
        )
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("codec", "pix_fmt", "name"),
    [
        ("png", "rgb24", "PNG"),
        ("mjpeg", "yuvj420p", "JPEG"),
        ("gif", "rgb8", "GIF"),
        ("bmp", "bgr24", "BMP"),
        ("libwebp", "yuv420p", "WebP"),
    ],
)
def test_declared_size_of_real_files(codec, pix_fmt, name):
    try:
        data = _encode(codec, 48, 40, pix_fmt)
    except (av.FFmpegError, ValueError) as exc:  # (an FFmpeg build without this encoder)
        pytest.skip(f"{codec}: {exc}")
    assert image_size(data) == (name, 48, 40)


def test_unknown_or_truncated_headers_say_nothing():
    assert image_size(b"abcd") is None
    assert image_size(b"\x89PNG\r\n\x1a\n") is None
    assert image_size(b"\xff\xd8\xff\xe0") is None


def test_the_request_check_refuses_an_oversized_image_and_keeps_a_normal_one():
    big = _encode("png", MAX_IMAGE_SIDE + 32, 8)
    with pytest.raises(ValidationError, match=f"PNG image of {MAX_IMAGE_SIDE + 32}x8 pixels"):
        RenderRequest(prompt="x", images=[{"data": base64.b64encode(big).decode()}])
    ok = _encode("png", 64, 48)
    assert RenderRequest(prompt="x", images=[{"data": base64.b64encode(ok).decode()}]).images
