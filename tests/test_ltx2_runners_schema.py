"""The request schema and the runners agree: the job arguments are declared once (`RenderArgs`) and equal
`RenderRequest`'s fields (+ `output_path` and `media`, which the worker sets) with the same defaults; every
runner's `__call__` exposes exactly them to the controller's kwarg binding; conditioning images validated
at the edge decode in the runner (and bad ones never reach it)."""

from __future__ import annotations

import base64
import dataclasses
import inspect

import pytest
from pydantic import ValidationError

from ltx_contract.schema import MAX_IMAGES, RenderRequest


def test_render_args_are_the_request_fields():
    from ltx_mgpu.runners.common.args import RenderArgs

    args = {f.name: f for f in dataclasses.fields(RenderArgs)}
    assert set(args) == set(RenderRequest.model_fields) | {"output_path", "media", "memory_plan"}
    for name, field in RenderRequest.model_fields.items():
        if field.is_required():
            assert args[name].default is dataclasses.MISSING, name
        else:
            assert args[name].default == field.get_default(), name  # the same defaults on both sides


def test_every_runner_binds_exactly_the_render_args():
    from ltx_mgpu.control.fleet import check_job_kwargs
    from ltx_mgpu.runners.common.args import RenderArgs
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner
    from ltx_mgpu.runners.smoke import SmokeRunner

    fields = {f.name for f in dataclasses.fields(RenderArgs)}
    job = RenderRequest(prompt="x", images=None).runner_kwargs() | {"output_path": "/tmp/x.mp4"}
    for runner in (Ltx2DistilledRunner, Ltx2TwoStageRunner, SmokeRunner):
        params = set(inspect.signature(runner.__call__).parameters) - {"self"}
        assert params == fields, (runner.__name__, params ^ fields)
        check_job_kwargs(runner, job)  # what the controller does before dispatch
        with pytest.raises(TypeError, match="unexpected keyword argument 'audi'"):
            check_job_kwargs(runner, {**job, "audi": False})


def test_audio_field_is_validated_at_the_edge():
    assert RenderRequest(prompt="x").runner_kwargs()["audio"] is True
    assert RenderRequest(prompt="x", audio=False).runner_kwargs()["audio"] is False
    with pytest.raises(ValidationError, match="audio"):
        RenderRequest(prompt="x", audio="sometimes")


def test_images_round_trip_from_request_to_runner():
    from ltx_mgpu.runners.ltx2.images import parse_images

    from .test_ltx2_runners import png_b64

    request = RenderRequest(prompt="x", num_frames=17, images=[{"data": png_b64(), "frame": 8, "strength": 0.5}])
    kwargs = request.runner_kwargs()
    images = parse_images(kwargs["images"], kwargs["num_frames"])
    assert len(images) == 1 and images[0].frame == 8 and images[0].strength == 0.5
    assert images[0].pixels.shape == (40, 48, 3)
    assert "images" not in RenderRequest(prompt="x").runner_kwargs()  # unset: runners without images work


#: a PNG header declaring 48x40 pixels: all the request check reads (nothing decodes it there)
_PNG_HEADER = base64.b64encode(
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR" + (48).to_bytes(4, "big") + (40).to_bytes(4, "big")
).decode()


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ({"data": "not base64!"}, "base64"),
        ({"data": base64.b64encode(b"abcd").decode(), "frame": 4}, "multiple of 8"),
        ({"data": _PNG_HEADER, "frame": 24}, "past the last frame"),  # (a sized image: this check runs last)
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
