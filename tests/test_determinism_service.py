"""Reproducible renders through the whole service on a CPU fleet (deterministic by default there): real Redis,
real S3 (SeaweedFS), a real `ltx-worker one` with the smoke model on two CPU ranks (SP over gloo).

The same request and seed renders the same frames and audio, job after job and across a fleet rebuild (a rank
killed between them); another seed renders other frames (so equal hashes are not a constant); and the hashes
appear where a user reads them: `producer status --json` (`digests`) and the job's result, beside the mp4's
sha256. The tiny LTX-2 runner, with a LoRA job between two equal ones, is covered by tests/test_bench_loras.py
(`bench/loras.py` compares the phases by these hashes)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
from click.testing import CliRunner

from producer.cli import cli
from tests.test_worker_service import running_worker
from tests.test_worker_support import enqueue, wait_for, wait_state

pytestmark = pytest.mark.timeout(600)
REQUEST = {"prompt": "a red fox in the snow", "width": 64, "height": 64, "num_frames": 9, "seed": 7}
HEX = set("0123456789abcdef")


def _status_json(redis_url: str, job_id: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["status", "--json", job_id], env={"LTX_REDIS_URL": redis_url},
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _render(fleet: Any, redis_url: str, **change: Any) -> dict[str, Any]:
    job = enqueue(fleet.conn, fleet.queue, {**REQUEST, **change})
    assert wait_state(job, {"uploaded", "failed"}, 240, fleet.proc) == "uploaded", fleet.proc.log_tail()
    return _status_json(redis_url, job.id)


def _kill_a_rank_and_wait_for_the_rebuild(fleet: Any) -> None:
    info = fleet.idle()
    pids, rebuilds = info["fleet"]["pids"], info["fleet"]["rebuilds"]
    os.kill(pids[1], signal.SIGKILL)

    def rebuilt() -> bool:
        now = fleet.idle()["fleet"]
        return now["rebuilds"] > rebuilds and set(now["pids"]).isdisjoint(pids)

    wait_for(rebuilt, 240, "the fleet rebuilt after a rank kill", on_fail=fleet.proc.log_tail)


def test_same_request_same_frames_and_audio_across_jobs_and_a_rebuild(tmp_path, redis_server, s3_server):
    with running_worker(tmp_path, redis_server, s3_server, runner="smoke", group="cpu:2") as fleet:
        first = _render(fleet, redis_server.url)
        other_seed = _render(fleet, redis_server.url, seed=8)
        second = _render(fleet, redis_server.url)
        _kill_a_rank_and_wait_for_the_rebuild(fleet)
        after_rebuild = _render(fleet, redis_server.url)

    digests = first["digests"]
    assert digests is not None, first
    assert set(digests["frames_sha256"]) <= HEX and len(digests["frames_sha256"]) == 64
    assert set(digests["audio_sha256"]) <= HEX and len(digests["audio_sha256"]) == 64  # (the smoke model has audio)
    assert digests["frames_layout"] == "yuv420p-uint8-FHW" and digests["audio_layout"] == "float32le-CS"
    assert digests["deterministic"] == "on"  # (`auto` on a CPU fleet)
    # the job's result carries them beside the mp4's sha256
    assert first["result"]["digests"] == digests and len(first["result"]["sha256"]) == 64

    def parts(job: dict[str, Any]) -> tuple[str, str]:
        return job["digests"]["frames_sha256"], job["digests"]["audio_sha256"]

    assert parts(second) == parts(first), (first["digests"], second["digests"])
    assert parts(after_rebuild) == parts(first), (first["digests"], after_rebuild["digests"])
    assert second["result"]["sha256"] == first["result"]["sha256"]  # (equal frames and audio: the same mp4)
    assert other_seed["digests"]["frames_sha256"] != digests["frames_sha256"]
    assert other_seed["digests"]["audio_sha256"] != digests["audio_sha256"]
