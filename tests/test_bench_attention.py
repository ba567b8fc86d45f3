"""`python -m bench.attention` runs its CPU smoke version: a row per backend and shape, and a SUMMARY with ratios.

Its numerics check: bf16 SDPA against the float32 math reference on the same bf16 inputs. A bf16 kernel
rounds at most twice on the way (the attention probabilities before the value product, the output), each
by at most 2**-9 relative (round to nearest), so the relative error stays below 2 * 2**-9 plus float32
accumulation: the bound is 2**-8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_attention_bench_cpu_smoke() -> None:
    cmd = [sys.executable, "-m", "bench.attention", "--device", "cpu", "--shapes", "1x256x4x32,2x96x2x64",
           "--backends", "flash,cudnn,math", "--iters", "1", "--warmup", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("SUMMARY ")
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    rows = [json.loads(line) for line in lines[:-1]]
    assert rows[0]["kind"] == "meta"
    sdpa = [r for r in rows if r["kind"] == "sdpa"]
    assert {(r["shape"], r["backend"]) for r in sdpa} == {
        (s, b) for s in ("1x256x4x32", "2x96x2x64") for b in ("default", "flash", "cudnn", "math")
    }
    cudnn = [r for r in sdpa if r["backend"] == "cudnn"]
    assert all("unsupported" in r for r in cudnn), cudnn  # no cuDNN on a CPU: said, not fatal
    ran = [r for r in sdpa if "unsupported" not in r]
    assert ran and all(r["reference"] == "math_fp32" and 0 <= r["rel_err"] <= 2.0**-8 for r in ran), ran
    assert "1x256x4x32:flash" in summary["speedup_over_default"] and "1x256x4x32:cudnn" not in summary["rel_err"]


def test_attention_bench_candidates_on_cpu_are_skipped_with_a_reason_or_emulated() -> None:
    """Without CUDA the kernels say why they did not run; the FP8 emulation runs, and its error against
    float32 attention lies where tests/test_fp8_attention.py's e4m3 prediction puts it (0.5 to 1 times)."""
    from bench.attention import _qkv
    from tests.test_fp8_attention import predicted_rel_error

    cmd = [sys.executable, "-m", "bench.attention", "--device", "cpu", "--shapes", "1x256x4x32",
           "--backends", "flash", "--candidates", "cudnn-fp8,sage-int8,fp8-emulate", "--iters", "1",
           "--warmup", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["backend"]: r for r in map(json.loads, done.stdout.strip().splitlines()[:-1]) if r["kind"] == "candidate"}
    assert set(rows) == {"cudnn-fp8", "sage-int8", "fp8-emulate"}
    assert "needs a CUDA device" in rows["cudnn-fp8"]["unsupported"] and "unsupported" in rows["sage-int8"]
    q, k, v = (x.double() for x in _qkv(1, 256, 4, 32, torch.device("cpu"), torch.bfloat16))
    predicted = predicted_rel_error(q, k, v)
    assert 0.5 * predicted <= rows["fp8-emulate"]["rel_err"] <= predicted, (rows["fp8-emulate"], predicted)
