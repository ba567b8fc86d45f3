"""Runner request limits (ltx_contract.limits): what a runner class publishes without a fleet, and the check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ltx_contract.limits import RunnerLimits
from ltx_contract.schema import RenderRequest
from ltx_mgpu import MGPURunner
from ltx_mgpu.runners.smoke import SmokeRunner


class _Odd(MGPURunner):
    @classmethod
    def request_limits(cls, **setup_kwargs: Any) -> dict[str, tuple[float, float]]:
        return {"colour": (0, 1)}

    def setup(self) -> None:
        pass

    def __call__(self) -> Iterator[Any]:
        yield None


def test_smoke_runner_publishes_its_step_limit_from_its_setup_kwargs() -> None:
    assert RunnerLimits.of("smoke", SmokeRunner, {}).ranges == {"steps": (1.0, 50.0), "audio_latents": (1.0, 6144.0)}
    limits = RunnerLimits.of("smoke", SmokeRunner, {"max_steps": 8})
    assert limits.ranges == {"steps": (1.0, 8.0), "audio_latents": (1.0, 6144.0)}
    bad = limits.violations(RenderRequest(prompt="x", steps=9))
    assert [v.message() for v in bad] == ["steps: 9 is outside [1, 8] accepted by runner 'smoke'"]
    assert limits.violations(RenderRequest(prompt="x")) == []  # unset: the runner's default applies
    assert RunnerLimits.from_json(limits.to_json()) == limits


def test_a_subclass_that_passes_setup_kwargs_on_keeps_its_base_defaults() -> None:
    """Found by the chaos CI: the chaos runner's `setup(*, exec_log_dir, **kwargs)` hid SmokeRunner's
    `max_steps` default and every worker died at start."""
    from tests.chaos.runner import ChaosRunner

    assert RunnerLimits.of("chaos", ChaosRunner, {"exec_log_dir": "/x"}).ranges["steps"] == (1.0, 50.0)
    assert RunnerLimits.of("chaos", ChaosRunner, {"max_steps": 3}).ranges["steps"] == (1.0, 3.0)
    with pytest.raises(TypeError, match="declares no default for 'nope'"):
        ChaosRunner.setup_default("nope", {})


def test_the_audio_length_is_checked_against_the_runners_token_budget() -> None:
    """A security review: the audio track (num_frames / frame_rate x 25 latents) was never checked; a
    request may be within every field's range and still too long for the runner's budget."""
    limits = RunnerLimits.of("smoke", SmokeRunner, {"max_tokens": 4096})
    assert limits.ranges["audio_latents"] == (1.0, 4096.0)
    assert limits.violations(RenderRequest(prompt="x", num_frames=257, frame_rate=24.0)) == []
    bad = limits.violations(RenderRequest(prompt="x", num_frames=257, frame_rate=1.5))
    assert [v.message() for v in bad] == ["audio_latents (the audio length in latents: num_frames / frame_rate x 25): "
                                          "4283 is outside [1, 4096] accepted by runner 'smoke'"]  # fmt: skip
    assert RunnerLimits.from_json(limits.to_json()) == limits


def test_limits_must_name_request_fields_and_bad_json_is_ignored() -> None:
    with pytest.raises(ValueError, match="'colour', which is not a request field"):
        RunnerLimits.of("odd", _Odd, {})
    assert RunnerLimits.of("base", MGPURunner, {}).ranges == {}
    for junk in (None, {}, {"runner": "x"}, {"runner": "x", "ranges": {"steps": [1]}}, "text"):
        assert RunnerLimits.from_json(junk) is None


def test_a_streaming_fleet_refuses_prompt_enhancement_at_the_edge() -> None:
    """A fleet whose text encoder streams from host memory (its published placement) refuses `enhance_prompt`
    in one line, the same words its ranks use; the other placements and requests without it pass."""
    from ltx_contract.schema import RenderRequest
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner
    from ltx_mgpu.spec.placement import STREAMED_ENHANCE_REFUSAL

    request = {"prompt": "a cat", "width": 768, "height": 512, "num_frames": 121}
    for tier in ("gpu", "park", "stream"):
        limits = RunnerLimits.of("d", Ltx2DistilledRunner, {"placement": {"text_encoder": tier}})
        limits = RunnerLimits.from_json(limits.to_json())  # (as the producer reads it from the worker's snapshot)
        assert limits is not None and limits.memory is not None and limits.memory.text_encoder_at == tier
        plain = limits.violations(RenderRequest.model_validate(request))
        enhanced = limits.violations(RenderRequest.model_validate({**request, "enhance_prompt": True}))
        assert plain == [] and [v.field for v in enhanced] == (["enhance_prompt"] if tier == "stream" else [])
        if enhanced:
            assert enhanced[0].message().startswith(STREAMED_ENHANCE_REFUSAL) and "\n" not in enhanced[0].message()
