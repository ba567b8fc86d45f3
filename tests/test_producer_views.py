"""What the producer shows about a job (unit tests, no Redis): the status view of a job enqueued through
plain RQ, the LoRAs in `status --json`, the refusal of a LoRA name when a worker has no catalogue, and a fleet
failure as `watch` prints it."""

from __future__ import annotations

from ltx_contract.health import LoraOffer
from ltx_contract.schema import RenderRequest
from producer.display import request_line
from producer.loras import lora_problems
from producer.models import JobInfo


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


def test_watch_shows_a_fleet_failures_error_id_once() -> None:
    """`watch` printed `... [error id err-x: details in the worker log], error_id=err-x`: the message the worker
    writes (`WarmFleet.describe`) already ends with the id."""
    import io

    from rich.console import Console

    from producer.display import EventPrinter
    from producer.models import JobEvent
    from worker.render.fleet import WarmFleet

    class RankDied(Exception):
        reason, rank, pid, exitcode = "rank_died", 0, 12, -9

    info = WarmFleet.describe(RankDied("rank 0 died\nrank 0 (pid 12) exit -9:\nTraceback\nRuntimeError: boom"))
    assert info["error_id"] and info["error_id"] in info["message"]
    out = io.StringIO()
    printer = EventPrinter(Console(file=out, width=300), "j", live=False)
    printer.show(JobEvent("1-0", "fleet", {"type": "fleet", "action": "failed", **info, "ts": 0.0}))
    (line,) = out.getvalue().splitlines()
    assert line.count(info["error_id"]) == 1, line
    assert "fleet failed: fleet_reason=rank_died, rank=0, pid=12, exitcode=-9, message=rank 0 died" in line, line
