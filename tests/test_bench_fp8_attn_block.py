"""`python -m bench.fp8_attn_block --fused` runs its CPU smoke version: two rows per token count (timesteps per
token and one for all tokens) with every variant timed and compared with the bf16 block, and a SUMMARY line.

On a CPU the fused block runs `ltx_mgpu.fused.ops`' eager definitions, which are ltx-core's expressions in
ltx-core's order, so it computes what the unfused `fp8-mm+attn` block computes, bit for bit: the two errors
against bf16 are the same number. The FP8 variants' errors are e4m3 rounding of activations and weights (a
relative 2**-4 at most per element, far less on average): nonzero, and well under the 2**-4 bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fp8_attn_block_bench_with_the_fused_candidate_on_cpu() -> None:
    cmd = [sys.executable, "-m", "bench.fp8_attn_block", "--device", "cpu", "--dims", "tiny", "--tokens", "96",
           "--iters", "1", "--warmup", "0", "--fused"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("SUMMARY ") and "fused" in lines[-1]
    rows = {r["timesteps"]: r for r in map(json.loads, lines[:-1]) if r.get("kind") == "block"}
    assert set(rows) == {"per-token", "one"}  # the default: both, side by side
    names = ("fp8_mm", "fp8_mm_attn", "fp8_mm_attn_unshifted", "fp8_mm_attn_fused")
    for row in rows.values():
        assert not [k for k in row if k.endswith("_error")], row
        for name in names:
            assert row[f"{name}_ms"] > 0 and row[f"{name}_speedup"] > 0, (name, row)
            assert 0 < row[f"{name}_rel_err_video"] < 2.0**-4, (name, row)
        assert row["fp8_mm_attn_fused_rel_err_video"] == row["fp8_mm_attn_rel_err_video"]
        assert row["fp8_mm_attn_fused_rel_err_video_update"] == row["fp8_mm_attn_rel_err_video_update"]
    # the one-timestep row also says what it gains over the per-token bf16 block of the same run
    assert all(rows["one"][f"{name}_speedup_vs_per_token_bf16"] > 0 for name in ("bf16", *names))
