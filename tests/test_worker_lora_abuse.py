"""Every bad LoRA kind against a live worker (real Redis, real S3 on SeaweedFS, `ltx-worker one` with the
two-stage runner on tiny checkpoints over CPU ranks): each job ends as `invalid_request` naming the entry and
what is wrong, after one attempt, and the next good jobs (a catalogue LoRA, an S3 LoRA) render on the same
fleet: same rank pids, no rebuild.
"""

from __future__ import annotations

import json
import pickle
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from rq.job import JobStatus

from producer.cli import cli
from tests.support.fleet import Fleet, running_worker
from tests.support.workers import enqueue, wait_rq_status, wait_state

from .test_lora_file import write_st
from .test_ltx2_runners import SETUP

pytestmark = pytest.mark.timeout(900)

JOB = {"prompt": "a cat", "width": 128, "height": 128, "num_frames": 9, "frame_rate": 8.0, "audio": False}


def lora_tensors(targets: dict[str, tuple[int, int]], *, rank: int = 4, dtype: str = "BF16", keys: int = 3) -> dict:
    out = {}
    for key, (rows, cols) in sorted(targets.items())[:keys]:
        base = "diffusion_model." + key[: -len(".weight")]
        out[f"{base}.lora_A.weight"] = (dtype, [rank, cols])
        out[f"{base}.lora_B.weight"] = (dtype, [rows, rank])
    return out


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    from ltx_mgpu.lora_file import transformer_targets
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    tiny = ensure_tiny_ltx2()
    tmp = tmp_path_factory.mktemp("lora-abuse")
    targets = transformer_targets(tiny.setup_kwargs()["checkpoint_path"])
    cat = tmp / "catalogue"
    cat.mkdir()
    write_st(cat / "good.safetensors", lora_tensors(targets))
    unknown = {**lora_tensors(targets), "diffusion_model.not_a_block.lora_A.weight": ("BF16", [4, 8])}
    write_st(cat / "unknown-keys.safetensors", unknown)
    shapes = lora_tensors(targets)
    first = next(iter(shapes))
    shapes[first] = ("BF16", [4, shapes[first][1][1] + 1])
    write_st(cat / "wrong-shape.safetensors", shapes)
    write_st(cat / "truncated.safetensors", lora_tensors(targets), cut=7)
    (cat / "pickled.safetensors").write_bytes(pickle.dumps({"weights": [1, 2]}))
    write_st(cat / "bad-dtype.safetensors", lora_tensors(targets, dtype="F64"))
    write_st(cat / "high-rank.safetensors", lora_tensors(targets, rank=32))
    write_st(cat / "huge.safetensors", lora_tensors(targets))
    with open(cat / "huge.safetensors", "r+b") as f:
        f.truncate(20 << 30)  # sparse: 20 GB apparent, nothing written
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_server.bucket, Key="loras/u/good.safetensors",
                  Body=write_st(tmp / "s3good.safetensors", lora_tensors(targets, keys=5)).read_bytes())  # fmt: skip
    s3.put_object(Bucket=s3_server.bucket, Key="loras/u/pickled.safetensors", Body=pickle.dumps([1]))
    setup = {**tiny.setup_kwargs(), **SETUP}
    with running_worker(tmp, redis_server, s3_server, handle=Fleet, runner="ltx2-two-stage", group="cpu:2",
                        runner_setup=json.dumps(setup), fleet_start_timeout=400, render_timeout=600,
                        lora_catalogue=cat, lora_s3_prefixes=f"{s3_server.bucket}/loras/u/", lora_max_rank=16,
                        lora_cache_dir=tmp / "lora-cache") as w:  # fmt: skip
        w.bucket, w.redis_url = s3_server.bucket, redis_server.url
        yield w


BAD = [
    ({"name": "unknown-keys"}, "not_a_block.lora_A.weight.*not a LoRA-able transformer weight"),
    ({"name": "wrong-shape"}, "do not fit it"),
    ({"name": "truncated"}, "truncated"),
    ({"name": "pickled"}, "a Python pickle"),
    ({"name": "bad-dtype"}, "is F64; allowed"),
    ({"name": "high-rank"}, "rank 32; allowed 1..16"),
    ({"name": "huge"}, "21474836480 bytes, over the"),
    ({"name": "crane"}, "crane: not in the catalogue"),
    ({"uri": "s3://{bucket}/loras/u/missing.safetensors"}, "no such object"),
    ({"uri": "s3://{bucket}/loras/u/pickled.safetensors"}, "a Python pickle"),
    ({"uri": "s3://{bucket}/videos/x.safetensors"}, "under no prefix this worker allows"),
]


def test_each_bad_lora_fails_its_job_and_good_ones_render_on_the_same_fleet(worker) -> None:
    health = worker.idle(300)
    before = health["fleet"]
    offer = health["loras"]  # what `producer submit --dry-run` checks a request against
    assert "good" in offer["names"] and offer["max_per_request"] == 4, offer
    env = {"LTX_REDIS_URL": worker.redis_url, "LTX_QUEUES": worker.queue}
    request = Path(worker.spool).parent / "request.json"
    request.write_text(json.dumps(JOB))
    dry = CliRunner().invoke(cli, ["submit", str(request), "--lora", "crane", "--dry-run"], env=env)
    assert dry.exit_code == 2 and "'crane' is not in the worker's catalogue" in dry.stderr, dry.output
    assert CliRunner().invoke(cli, ["submit", str(request), "--lora", "good:0.5", "--dry-run"], env=env).exit_code == 0
    for bad, message in BAD:
        lora = {k: v.format(bucket=worker.bucket) for k, v in bad.items()}
        job = enqueue(worker.conn, worker.queue, {**JOB, "loras": [{"name": "good"}, lora]})
        wait_rq_status(job, {JobStatus.FAILED}, 120, worker.proc)
        time.sleep(0.3)
        meta = job.get_meta(refresh=True)
        error = meta["error"]
        assert (error["reason"], error["field"], error["retryable"]) == ("invalid_request", "loras[1]", False), meta
        assert re.search(message, error["message"]), (message, error["message"])
        assert len(meta["attempts"]) == 1 and "rendering" not in str(meta.get("state"))
        assert str(Path(worker.spool).parent) not in error["message"]  # no worker paths in what a client sees
    for loras in ([{"name": "good", "strength": 0.5}], [{"uri": f"s3://{worker.bucket}/loras/u/good.safetensors"}]):
        job = enqueue(worker.conn, worker.queue, {**JOB, "loras": loras})
        assert wait_state(job, {"uploaded", "failed"}, 400, worker.proc) == "uploaded", job.get_meta(refresh=True)
        used = job.get_meta(refresh=True)["loras"]
        assert [u["lora"] for u in used] == [loras[0].get("name") or loras[0]["uri"]]
        status = CliRunner().invoke(cli, ["status", job.id], env={"LTX_REDIS_URL": worker.redis_url})
        assert f"{used[0]['lora']} x{used[0]['strength']}" in status.stdout, status.stdout  # producer status
        assert job.get_meta(refresh=True)["lora_swap_s"] > 0 and "lora swap" in status.stdout
    port = worker.health()["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ltx_worker_lora")]
    samples = {name: float(value) for name, value in lines}
    group = 'group="cpu:2"'
    # every bad entry is refused before any fetch (from its size, its uri, or its header: a catalogue file's, an
    # object's first range), so no bad job fetched "good"; the two good jobs are the two misses, and no job hit
    assert samples[f'ltx_worker_lora_cache_total{{{group},result="miss"}}'] == 2, samples
    assert samples.get(f'ltx_worker_lora_cache_total{{{group},result="hit"}}', 0.0) == 0, samples
    assert samples[f"ltx_worker_lora_swap_seconds_count{{{group}}}"] == 2, samples
    after = worker.idle()["fleet"]
    assert (after["pids"], after["builds"], after["rebuilds"]) == (before["pids"], before["builds"], before["rebuilds"])
