"""`python -m bench.sp_scaling` in its CPU mode (`--device cpu --dims tiny`): the benchmark's whole path (fleets
of 1 and 2 CPU ranks under `MGPUController`, every layout, eager and graphed modes, comparison with W=1,
calibration, summary) runs and reports what it must. Timings on CPU mean nothing and are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.numerics
def test_cpu_mode_reports_every_layout_and_mode() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sp_scaling", "--device", "cpu", "--dims", "tiny"],
        check=False,
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("SUMMARY ")
    summary = json.loads(lines[-1][len("SUMMARY ") :])
    records = [json.loads(line) for line in lines[:-1]]
    env = records[0]
    assert env["kind"] == "env" and env["nccl_env"]["NCCL_NVLS_ENABLE"] == "0"
    rows = [r for r in records if r["kind"] == "row"]
    seen = {(r["world"], r["passes"], r["layout"], r["mode"]) for r in rows}
    assert seen == {
        (1, 1, "1x1", "eager"),
        (1, 1, "1x1", "graphed"),
        (1, 3, "1x1", "eager"),
        (1, 3, "1x1", "graphed"),
        (2, 1, "1x2", "eager"),
        (2, 1, "1x2", "graphed"),
        (2, 3, "1x2", "eager"),
        (2, 3, "1x2", "graphed"),
        (2, 3, "2x1", "eager"),
        (2, 3, "2x1", "graphed"),
    }
    for r in rows:
        # fp32 on CPU ranks: every layout agrees with one rank up to summation order (see TOL in
        # tests/test_sp_parallel.py for the derivation at the tiny model's sizes)
        assert r["max_abs_diff"] <= 1e-5, r
        assert r["ms_per_layer"] > 0 and r["speedup"] is not None and r["model_choice"] in ("1x1", "1x2", "2x1")
        assert r["path"] == ("eager: not CUDA" if r["mode"] == "graphed" else "eager (eager)"), r
        if r["world"] == 2:
            assert len(r["rank_ms"]) == 2
    assert any(r["kind"] == "calibration" for r in records)
    assert "W2 T37 P3 eager" in summary["best"] and summary["max_ulps_vs_W1"] is not None
