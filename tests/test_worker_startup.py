"""A worker's fleet start at the size that matters: warm-up before the first job, the start split into
phases (health snapshot and metrics), and a long rebuild that keeps the worker registered and visible.

Real Redis, real S3 (SeaweedFS), a real `ltx-worker one` with a CPU fleet of two ranks running the
fault-injection runner, whose `setup()` sleeps to stand in for a model load.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.support.runners import read_records
from tests.support.wait import wait_for
from tests.support.workers import enqueue, launch_worker, wait_ready, wait_state, worker_health

pytestmark = pytest.mark.timeout(240)

SETUP_S = 0.5
WARMUP_STEP_S = 0.3


@pytest.fixture(scope="module")
def warm_worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("startup")
    record = tmp / "exec.jsonl"
    slow = tmp / "slow-rebuilds"
    warmup = [{"prompt": f"warm step_s={WARMUP_STEP_S} record={record}", "steps": 2, "width": 64, "height": 64,
               "num_frames": 9}]  # fmt: skip
    t_launch = time.time()
    synthetic = tmp / "synthetic.safetensors"  # (what the LTX-2 runners warn about, from the driver rank)
    save_file({"w": torch.zeros(1)}, str(synthetic), metadata={"synthetic": "true"})
    setup = {"setup_s": SETUP_S, "slow_if_exists": str(slow), "slow_s": 4.0, "synthetic_checkpoint": str(synthetic)}
    w = launch_worker(tmp, redis_server, s3_server, ["one", "--group", "cpu:2"], prefix="s", log_name="worker.log",
                      runner_setup=json.dumps(setup), warmup_requests=json.dumps(warmup),
                      retry_fleet_failure=0)  # fmt: skip
    proc, conn, queue, name = w.proc, w.conn, w.queue, w.name
    try:
        (info,) = wait_ready(conn, name, 1, 120, proc)
        yield {"conn": conn, "queue": queue, "name": name, "proc": proc, "record": record, "slow": slow,
               "t_launch": t_launch, "first": info}  # fmt: skip
    finally:
        rc = proc.stop()
        conn.close()
        assert rc == 0, proc.log_tail()


def test_warm_up_runs_before_the_first_job_and_the_start_is_split_into_phases(warm_worker):
    w = warm_worker
    info = w["first"]
    startup = info["fleet"]["startup"]
    assert startup["warmup_jobs"] == 1 and startup["warmup_s"] >= 2 * WARMUP_STEP_S, startup
    assert startup["weight_load_s"] >= SETUP_S and startup["process_start_s"] > 0, startup
    phases = startup["process_start_s"] + startup["weight_load_s"] + startup["warmup_s"]
    assert startup["ready_s"] == pytest.approx(phases, abs=0.01), startup  # the phases add up (rounding only)
    assert w["t_launch"] - 0.05 <= info["process_started_at"] <= startup["started_at"] <= startup["ready_at"]
    assert [r["rank"] for r in startup["ranks"]] == [0, 1] and info["fleet"]["devices"] == ["cpu", "cpu"]
    # The warm-up request really rendered on the fleet, before it reported ready...
    warm = read_records(w["record"])
    assert [r["event"] for r in warm] == ["start", "end"] and warm[1]["t"] <= startup["ready_at"]
    # ... and before the first job, which is not the first render on this fleet.
    job = enqueue(w["conn"], w["queue"], {"prompt": f"t record={w['record']}", "width": 64, "height": 64})
    assert wait_state(job, {"uploaded", "failed"}, 60, w["proc"]) == "uploaded"
    assert [r["event"] for r in read_records(w["record"])] == ["start", "end", "start", "end"]
    # The phases are metrics too.
    with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    gauges = dict(re.findall(r'ltx_worker_fleet_start_seconds\{group="cpu:2",phase="(\w+)"\} (\S+)', text))
    assert set(gauges) == {"process_start", "weight_load", "warmup", "ready"}, text[-2000:]
    assert float(gauges["warmup"]) == pytest.approx(startup["warmup_s"], abs=1e-3)


def test_a_long_rebuild_keeps_the_worker_visible_with_its_fleet_starting(warm_worker):
    """The rebuild after a fleet failure happens outside any job; at real size it can outlast the worker's
    registration. The health key must keep beating (state `starting`) while it runs."""
    w = warm_worker
    before = wait_ready(w["conn"], w["name"], 1, 60, w["proc"])[0]
    w["slow"].touch()  # rebuilds now take 4 s longer
    job = enqueue(w["conn"], w["queue"], {"prompt": "t exit_rank=1 exit_step=1", "width": 64, "height": 64})
    assert wait_state(job, {"uploaded", "failed"}, 60, w["proc"]) == "failed"
    seen: dict[float, str] = {}

    def rebuilt() -> bool:
        (info,) = worker_health(w["conn"], w["name"])
        seen[info["ts"]] = info["fleet"]["state"]
        return info["fleet"]["alive"] and info["fleet"]["rebuilds"] > before["fleet"]["rebuilds"]

    wait_for(rebuilt, 90, "the slow rebuild", poll=0.1, on_fail=w["proc"].log_tail)
    w["slow"].unlink()
    starting = sorted(ts for ts, state in seen.items() if state == "starting")
    assert len(starting) >= 2, f"health not refreshed during the rebuild: {seen}"
    assert starting[-1] - starting[0] >= 1.0, seen
    assert Path(w["record"]).exists()


def test_the_ranks_log_json_like_the_worker(warm_worker):
    """The driver rank's synthetic-weights warning was a plain-text line in the worker's JSON log (ranks had
    no logging set up: Python's last resort printed the bare message). The ranks log as the worker does now:
    a JSON record with the worker's group and name, from the rank's pid."""
    first = warm_worker["first"]
    lines = Path(warm_worker["proc"].log_path).read_text().splitlines()
    warned = [line for line in lines if "SYNTHETIC weights" in line]  # (one per build: the rebuild test adds one)
    assert warned, "\n".join(lines[-40:])
    records = [json.loads(line) for line in warned]  # (a plain-text line fails here)
    for record in records:
        assert (record["level"], record["logger"], record["group"]) == ("WARNING", "ltx_mgpu.runners", "cpu:2")
        assert record["worker"] == first["worker"] and record["pid"] != first["pid"], record  # (a rank's)
    assert records[0]["pid"] == first["fleet"]["pids"][0]  # the first fleet's driver rank
