"""The worker's fleet path on real GPUs: the worker process never creates a CUDA context and its ranks sit on
their own GPU only (the last visible one, so a stray context on cuda:0 would show), and a rebuild after a
rank dies mid-job waits for the dead fleet's memory before the new one loads (each fleet holds 55% of its
GPU: two at once cannot fit, and the build may fail only once: `max_failures=1`).

Run on the GPU host:  pytest -m gpu tests/test_worker_fleet_gpu.py -v
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ltx_mgpu import FleetFailure
from tests.support.gpu_runners import DeviceProbeRunner
from worker.render.fleet import WarmFleet

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]

_WORKER_SIDE = """
import json, os, sys, pathlib, torch
from worker.render.fleet import WarmFleet
from worker.settings import load_settings, resolve_runner
from tests.support.gpu_runners import DeviceProbeRunner, check_placement
for name in ("smoke", "ltx2-distilled", "ltx2-two-stage"):  # import the real runners as a worker process does
    resolve_runner(load_settings(runner=name))
device, warm_dir = int(sys.argv[1]), pathlib.Path(sys.argv[2])
sup = WarmFleet(DeviceProbeRunner, [device], warmup=[{"busy_s": 0.1}], warmup_dir=warm_dir, start_timeout=300)
sup.start()
try:
    items = list(sup.controller.stream(busy_s=0.5))
    reports = [i for i in items if i.get("event") == "report"]
    note = check_placement(reports, absent=[os.getpid()])
    print(json.dumps({"reports": reports, "cuda_initialized": torch.cuda.is_initialized(), "note": note,
                      "startup": sup.startup}))
finally:
    sup.shutdown(10)
"""


def test_worker_process_holds_no_cuda_context_and_ranks_stay_on_their_gpu(tmp_path: Path) -> None:
    device = torch.cuda.device_count() - 1
    out = subprocess.run([sys.executable, "-c", _WORKER_SIDE, str(device), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (report,) = result["reports"]
    assert not result["cuda_initialized"]  # the worker side imported torch, the engine and the runners; no CUDA
    assert report["device"] == f"cuda:{device}" and report["current"] == device
    assert result["startup"]["warmup_jobs"] == 1 and result["startup"]["weight_load_s"] >= 0
    print(result["note"])


def test_rebuild_after_a_rank_dies_waits_for_the_dead_fleets_memory() -> None:
    devices = [0, 1] if torch.cuda.device_count() >= 2 else [0]
    sup = WarmFleet(DeviceProbeRunner, devices, setup_kwargs={"hold_fraction": 0.55}, max_failures=1,
                          start_timeout=300, shutdown_timeout=5)  # fmt: skip
    sup.start()
    seconds = []
    try:
        for _cycle in range(3):
            ctl = sup.controller
            stream = ctl.stream(busy_s=120.0)
            next(stream)  # a rank started the job: the fleet is mid-job now
            os.kill(ctl.pids[-1], signal.SIGKILL)
            with pytest.raises(FleetFailure) as info:
                list(stream)
            sup.record_failure(info.value)
            t0 = time.monotonic()
            assert sup.ensure_ready()  # a new fleet holding 55% again: it fits only once the old one let go
            seconds.append(round(time.monotonic() - t0, 2))
            reports = [i for i in sup.controller.stream(busy_s=0.1) if i.get("event") == "report"]
            assert [r["device"] for r in sorted(reports, key=lambda r: r["rank"])] == [f"cuda:{d}" for d in devices]
        assert sup.rebuilds == 3 and sup.build_failures == 0
        print(f"rebuild after a rank kill on {devices}: {seconds} s")
    finally:
        sup.shutdown(10)
