"""`ltx_mgpu.spec.image_size`: the declared size of real image files of every supported format (encoded with
PyAV/FFmpeg), and the request check that uses it."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from pydantic import ValidationError

from ltx_contract.schema import RenderRequest
from ltx_mgpu.spec.image_size import MAX_IMAGE_SIDE, image_size


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


# ==== formats the size check cannot read are refused on both sides ======================================


@pytest.mark.parametrize(("codec", "pix_fmt"), [("tiff", "rgb24"), ("qoi", "rgb24")])
def test_formats_that_cannot_be_sized_before_decoding_are_refused_on_both_sides(codec, pix_fmt):
    """Regression: a TIFF (or any format `image_size` cannot read) passed the request
    check unsized and reached the runner's FFmpeg decoder, which decodes it whatever its size."""
    from ltx_mgpu.runners.ltx2.images import decode_image

    try:
        data = _encode(codec, 48, 40, pix_fmt)
    except (av.FFmpegError, ValueError) as exc:
        pytest.skip(f"{codec}: {exc}")
    assert image_size(data) is None
    with pytest.raises(ValidationError, match="not a PNG, JPEG, WebP, GIF or BMP file"):
        RenderRequest(prompt="x", images=[{"data": base64.b64encode(data).decode()}])
    with pytest.raises(ValueError, match="not a PNG, JPEG, WebP, GIF or BMP file"):  # the runner's own check
        decode_image(data)


def test_the_runner_decoder_checks_the_size_before_decoding():
    from ltx_mgpu.runners.ltx2.images import MAX_IMAGE_SIDE as RUNNER_MAX_SIDE
    from ltx_mgpu.runners.ltx2.images import decode_image

    assert RUNNER_MAX_SIDE == MAX_IMAGE_SIDE  # the same rule on both sides
    big = _encode("png", MAX_IMAGE_SIDE + 32, 8)
    with pytest.raises(ValueError, match=f"{MAX_IMAGE_SIDE + 32}x8 pixels"):
        decode_image(big)
    assert decode_image(_encode("png", 48, 40)).shape == (40, 48, 3)
