"""`python -m bench.e2e loras` on CPU, as CI runs it: the real stack (Redis, SeaweedFS, `ltx-worker` with one CPU rank,
the distilled runner on tiny checkpoints set up with `request_loras`), synthetic user LoRAs in a catalogue
and in S3, every phase rendered and every field the GPU run reports filled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_cpu_run_measures_every_phase(tmp_path):
    out = tmp_path / "loras.jsonl"
    cmd = [sys.executable, "-m", "bench.e2e", "loras", "--profile", "tiny", "--groups", "cpu:1", "--baseline", "1",
           "--switches", "2", "--s3", "1", "--out", str(out), "--workdir", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = out.read_text().splitlines()
    assert lines[-1].startswith("SUMMARY ") and proc.stdout.rstrip().splitlines()[-1] == lines[-1]
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    jobs = [json.loads(line) for line in lines[:-1]]
    assert [(j["phase"], j["lora"]) for j in jobs] == [
        ("baseline", None), ("first_catalogue", "user-a"), ("first_catalogue", "user-b"), ("switch", "user-a"),
        ("switch", "user-b"), ("swap_back", None), ("first_s3", "s3://videos/loras/bench/user-s3-0.safetensors"),
        ("swap_back", None), ("baseline", None),
    ]  # fmt: skip
    assert all(j["state"] == "uploaded" for j in jobs), jobs
    size = summary["written"]["s3"][0]["bytes"]
    for j in jobs:
        if j["lora"] is None:
            assert j["lora_cached"] is None and j["lora_fetch_bytes"] == 0 and "lora_swap_check" not in j["stages_s"]
            continue
        # every LoRA job: the ranks' header checks and the swap are timed, the worker's checks too
        assert j["stages_s"]["lora_swap_check"] > 0 and j["lora_swap_s"] > 0 and j["lora_verify_s"] > 0, j
        first = j["phase"].startswith("first")
        assert j["lora_cached"] is (not first) and (j["lora_fetch_bytes"] == size) is first, j
    assert summary["jobs_failed"] == summary["jobs_skipped"] == 0
    assert summary["failure"] is None and set(summary["phases"]) == {"baseline", "first_catalogue", "switch",
                                                                     "swap_back", "first_s3"}  # fmt: skip
    s3 = summary["phases"]["first_s3"]
    assert s3["lora_fetch_bytes_p50"] == size and s3["fetch_gb_per_s"] > 0 and s3["e2e_delta_p50_s"] is not None
    targets = summary["targets"]
    for name, limit in (("switch", 0.3), ("first_s3", 2.0)):
        t = targets[name]
        assert t["target_s"] == limit and t["adds_direct_s"] > 0 and isinstance(t["met"], bool), t
    # the job after a LoRA job renders the baseline's video (same request, same seed); the LoRA changes it
    back = targets["swap_back"]
    assert back["baseline_deterministic"] and back["swap_back_same_video"] and back["lora_changes_video"], back
    # compared by what was rendered (the worker's frames and audio sha256, before the encode): every job has
    # them, the jobs without LoRA rendered one video, and the LoRA jobs another each
    assert summary["deterministic"] is True and all(j["deterministic"] == "on" for j in jobs), jobs
    assert all(len(j["frames_sha256"]) == 64 and (j["audio_sha256"] is not None) is bool(j["audio"]) for j in jobs)
    plain = {(j["frames_sha256"], j["audio_sha256"]) for j in jobs if j["lora"] is None}
    assert len(plain) == 1 and not plain & {(j["frames_sha256"], j["audio_sha256"]) for j in jobs if j["lora"]}
    work = tmp_path / "work"  # the LoRA files and the S3 data are gone (GBs at real size), the logs stay
    assert not [p for p in ("catalogue", "staging", "lora-cache", "s3/data") if (work / p).exists()]
    assert list(work.glob("worker*.log"))
