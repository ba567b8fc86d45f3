"""What the producer shows about a job (unit tests, no Redis): the status view of a job enqueued through
plain RQ, the LoRAs in `status --json`, and the refusal of a LoRA name when a worker has no catalogue."""

from __future__ import annotations

from producer.display import request_line
from producer.loras import lora_problems
from producer.models import JobInfo
from worker.protocol.health import LoraOffer
from worker.protocol.schema import RenderRequest


def _info(meta: dict) -> JobInfo:
    return JobInfo("j", "uploaded", "finished", "q", meta, None, None, {"prompt": "p"}, None, None, None)


def test_a_request_with_only_a_prompt_shows_no_none() -> None:
    """Regression: a job enqueued through plain RQ showed `None x None, None frames, seed None`."""
    assert request_line({"prompt": "a fox"}) == '"a fox"'
    assert request_line({"prompt": "a fox", "num_frames": 9}) == '9 frames: "a fox"'
    full = {"prompt": "a fox", "width": 64, "height": 64, "num_frames": 9, "seed": 0}
    assert request_line(full) == '64x64, 9 frames, seed 0: "a fox"'


def test_status_json_has_the_loras_a_job_used_and_its_swap_time() -> None:
    """Regression: the text view showed them, `status --json` did not."""
    used = [{"lora": "dolly-in", "strength": 0.8, "cached": True}]
    data = _info({"loras": used, "lora_swap_s": 0.42}).as_json()
    assert data["loras"] == used and data["lora_swap_s"] == 0.42
    data = _info({"loras": "junk"}).as_json()  # (meta is written by whoever enqueues: only a list passes)
    assert data["loras"] == [] and data["lora_swap_s"] is None


def test_a_lora_name_against_a_worker_without_a_catalogue_says_so() -> None:
    """Regression: "'crane' is not in the worker's catalogue" when the worker has none at all."""
    request = RenderRequest(prompt="p", loras=[{"name": "crane"}])
    (problem,) = lora_problems(request, [("w1", LoraOffer((), (), None))])
    assert "has no LoRA catalogue (LTX_LORA_CATALOGUE" in problem and "uri" in problem
    (problem,) = lora_problems(request, [("w1", LoraOffer(("dolly-in",), (), None))])
    assert "'crane' is not in the worker's catalogue" in problem
