"""The request schema and the LTX-2 runners agree: every `RenderRequest` field is a job kwarg of both runners,
and conditioning images validated at the edge decode in the runner (and bad ones never reach it)."""

from __future__ import annotations

import base64
import inspect

import pytest
from pydantic import ValidationError

from worker.schema import MAX_IMAGES, RenderRequest


def test_every_request_field_is_a_runner_kwarg():
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner

    fields = set(RenderRequest.model_fields) | {"output_path"}
    for runner in (Ltx2DistilledRunner, Ltx2TwoStageRunner):
        params = set(inspect.signature(runner.__call__).parameters) - {"self"}
        assert fields <= params, (runner.__name__, fields - params)


def test_images_round_trip_from_request_to_runner():
    from ltx_mgpu.runners.ltx2.media import parse_images

    from .test_ltx2_runners import png_b64

    request = RenderRequest(prompt="x", num_frames=17, images=[{"data": png_b64(), "frame": 8, "strength": 0.5}])
    kwargs = request.runner_kwargs()
    images = parse_images(kwargs["images"], kwargs["num_frames"])
    assert len(images) == 1 and images[0].frame == 8 and images[0].strength == 0.5
    assert images[0].pixels.shape == (40, 48, 3)
    assert "images" not in RenderRequest(prompt="x").runner_kwargs()  # unset: runners without images work


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ({"data": "not base64!"}, "base64"),
        ({"data": base64.b64encode(b"abcd").decode(), "frame": 4}, "multiple of 8"),
        ({"data": base64.b64encode(b"abcd").decode(), "frame": 24}, "past the last frame"),
        ({"data": base64.b64encode(b"abcd").decode(), "strength": 1.5}, "less than or equal to 1"),
        ({"data": base64.b64encode(b"abcd").decode(), "path": "/etc/passwd"}, "Extra inputs"),
    ],
)
def test_bad_images_are_rejected_at_the_edge(image, message):
    with pytest.raises(ValidationError, match=message):
        RenderRequest(prompt="x", num_frames=17, images=[image])


def test_image_count_is_bounded():
    one = {"data": base64.b64encode(b"abcd").decode()}
    with pytest.raises(ValidationError, match=f"at most {MAX_IMAGES}"):
        RenderRequest(prompt="x", images=[one] * (MAX_IMAGES + 1))
