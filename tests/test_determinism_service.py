"""Reproducible renders through the whole service on a CPU fleet (deterministic by default, as on GPUs): real
Redis, real S3 (SeaweedFS), a real `ltx-worker one` with the smoke model on two CPU ranks (SP over gloo), and
with the tiny LTX-2 distilled runner on one.

The same request and seed renders the same frames and audio, job after job and across a fleet rebuild (a rank
killed between them); another seed renders other frames (so equal hashes are not a constant); and the hashes
appear where a user reads them: `producer status --json` (`digests`) and the job's result, beside the mp4's
sha256, with the mode that rendered them (`deterministic`: summary, result, `rendering` and `output` events;
`LTX_DETERMINISTIC=off`, the opt-out, is recorded the same way). LoRA jobs between equal ones (the tiny LTX-2
runner) are in tests/test_bench_loras.py (`python -m bench.e2e loras` compares its phases by these hashes)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
from click.testing import CliRunner

from producer.cli import cli
from tests.support.fleet import running_worker
from tests.support.wait import wait_for
from tests.support.workers import enqueue, events, wait_state

pytestmark = pytest.mark.timeout(900)
HEX = set("0123456789abcdef")
SMOKE = {"prompt": "a red fox in the snow", "width": 64, "height": 64, "num_frames": 9, "seed": 7}
#: the tiny LTX-2 checkpoints' size (as `python -m bench.e2e runs --profile tiny` renders them)
TINY = {"prompt": "a red fox in the snow", "width": 128, "height": 128, "num_frames": 9, "frame_rate": 8.0, "seed": 7}


def _tiny_distilled_setup() -> str:
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    setup = ensure_tiny_ltx2().setup_kwargs()
    setup.pop("distilled_lora_path", None)
    setup.update(prompt_tokens=128, default_steps=2, enhance_max_new_tokens=6, tdp_overlap=1)
    return json.dumps(setup)


#: (runner, device group, request, worker settings): the smoke model with SP over two ranks; the tiny LTX-2
#: distilled runner on one rank (its LoRA jobs between equal ones: tests/test_bench_loras.py)
RUNS = {
    "smoke-cpu2": ("smoke", "cpu:2", SMOKE, dict),
    "ltx2-distilled-cpu1": ("ltx2-distilled", "cpu:1", TINY, lambda: {"runner_setup": _tiny_distilled_setup()}),
}


def _status_json(redis_url: str, job_id: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["status", "--json", job_id], env={"LTX_REDIS_URL": redis_url},
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _render(fleet: Any, redis_url: str, request: dict[str, Any], **change: Any) -> dict[str, Any]:
    """`producer status --json` of one uploaded job, with `events`: its Redis Stream as a client reads it."""
    job = enqueue(fleet.conn, fleet.queue, {**request, **change})
    assert wait_state(job, {"uploaded", "failed"}, 240, fleet.proc) == "uploaded", fleet.proc.log_tail()
    return {**_status_json(redis_url, job.id), "events": events(fleet.conn, job.id)}


def _modes_recorded(job: dict[str, Any]) -> dict[str, Any]:
    """Where a job says which deterministic mode rendered it: the summary (`status --json`), the result, the
    `rendering` state event and the relayed `output` event."""
    by_type = {(e["type"], e.get("state")): e for e in job["events"]}
    return {
        "summary": job["deterministic"],
        "result": job["result"]["deterministic"],
        "rendering": by_type[("state", "rendering")].get("deterministic"),
        "output": by_type[("output", None)].get("deterministic"),
    }


def _kill_a_rank_and_wait_for_the_rebuild(fleet: Any) -> None:
    info = fleet.idle()
    pids, rebuilds = info["fleet"]["pids"], info["fleet"]["rebuilds"]
    os.kill(pids[-1], signal.SIGKILL)

    def rebuilt() -> bool:
        now = fleet.idle()["fleet"]
        return now["rebuilds"] > rebuilds and set(now["pids"]).isdisjoint(pids)

    wait_for(rebuilt, 240, "the fleet rebuilt after a rank kill", on_fail=fleet.proc.log_tail)


@pytest.mark.parametrize("case", sorted(RUNS))
def test_same_request_same_frames_and_audio_across_jobs_and_a_rebuild(tmp_path, redis_server, s3_server, case):
    runner, group, request, settings = RUNS[case]
    with running_worker(tmp_path, redis_server, s3_server, runner=runner, group=group, **settings()) as fleet:
        first = _render(fleet, redis_server.url, request)
        other_seed = _render(fleet, redis_server.url, request, seed=8)
        second = _render(fleet, redis_server.url, request)
        _kill_a_rank_and_wait_for_the_rebuild(fleet)
        after_rebuild = _render(fleet, redis_server.url, request)

    digests = first["digests"]
    assert digests is not None, first
    assert set(digests["frames_sha256"]) <= HEX and len(digests["frames_sha256"]) == 64
    assert set(digests["audio_sha256"]) <= HEX and len(digests["audio_sha256"]) == 64  # (both render audio)
    assert digests["frames_layout"] == "yuv420p-uint8-FHW" and digests["audio_layout"] == "float32le-CS"
    assert digests["deterministic"] == "on"  # (the default, `auto`)
    assert set(_modes_recorded(first).values()) == {"on"}, _modes_recorded(first)
    # the job's result carries them beside the mp4's sha256
    assert first["result"]["digests"] == digests and len(first["result"]["sha256"]) == 64

    def parts(job: dict[str, Any]) -> tuple[str, str]:
        return job["digests"]["frames_sha256"], job["digests"]["audio_sha256"]

    assert parts(second) == parts(first), (first["digests"], second["digests"])
    assert parts(after_rebuild) == parts(first), (first["digests"], after_rebuild["digests"])
    assert second["result"]["sha256"] == first["result"]["sha256"]  # (equal frames and audio: the same mp4)
    assert other_seed["digests"]["frames_sha256"] != digests["frames_sha256"]
    assert other_seed["digests"]["audio_sha256"] != digests["audio_sha256"]


def test_the_opt_out_is_recorded_where_the_mode_is_read(tmp_path, redis_server, s3_server):
    """`LTX_DETERMINISTIC=off` (the switch away from the default): the job says `off` in its summary, result,
    `rendering` and `output` events, also when the fleet writes the mp4 itself (`LTX_ENCODE_IN_WORKER=false`:
    no frames hand-off, so no `digests`, and the mode must still be there)."""
    settings = {"deterministic": "off", "encode_in_worker": "false"}
    with running_worker(tmp_path, redis_server, s3_server, runner="smoke", group="cpu:1", **settings) as fleet:
        job = _render(fleet, redis_server.url, SMOKE)
    assert set(_modes_recorded(job).values()) == {"off"}, _modes_recorded(job)
    assert job["digests"] is None  # (nothing handed off to hash)
    shown = CliRunner().invoke(cli, ["status", job["job_id"]], env={"LTX_REDIS_URL": redis_server.url})
    assert shown.exit_code == 0, shown.output
    assert any(line.split()[:2] == ["deterministic", "off"] for line in shown.output.splitlines()), shown.output
