"""scripts/test-numerics.sh emulates other machines: each setting caps all three libraries that pick
kernels by CPU (ATen by ATEN_CPU_CAPABILITY, MKL by MKL_CBWR, oneDNN by ONEDNN_MAX_CPU_ISA), since capping
ATen alone leaves MKL and oneDNN on this CPU's AVX-512 code (oneDNN's AVX-512 BF16 matmul ran under
ATEN_CPU_CAPABILITY=default). CI (.ci/run) runs two of the settings; this checks what each one exports."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _run(tmp_path: Path, settings: str, side_by_side: bool = False, tail: str = "") -> subprocess.CompletedProcess:
    """The script with a stand-in interpreter that prints the variables each pytest run would see, then runs
    the shell line `tail`."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + "".join(f'echo "{v}=${v}"\n' for v in _VARS) + 'echo "args=$*"\n' + tail)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (*_VARS, "LTX_NUMERICS_SIDE_BY_SIDE")}
    env.update(PYTHON_BIN=str(fake), LTX_NUMERICS_SETTINGS=settings, LTX_NUMERICS_SIDE_BY_SIDE=str(int(side_by_side)))
    return subprocess.run(["bash", str(ROOT / "scripts" / "test-numerics.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def _environments(tmp_path: Path, settings: str, side_by_side: bool = False) -> list[dict[str, str]]:
    """What each pytest run of the script would see, in the order the script prints them."""
    done = _run(tmp_path, settings, side_by_side)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    runs: list[dict[str, str]] = [{}]
    for line in out.splitlines():
        if line.startswith("args="):
            runs[-1]["args"] = line[5:]
            runs.append({})
        elif "=" in line and not line.startswith("=="):
            name, _, value = line.partition("=")
            runs[-1][name] = value
    return runs[:-1]


def test_each_setting_caps_aten_mkl_and_onednn_and_sets_the_threads(tmp_path: Path) -> None:
    runs = _environments(tmp_path, "default:1 avx2:2 avx512:2")
    assert [{k: r[k] for k in _VARS} for r in runs] == [
        dict(ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE", ONEDNN_MAX_CPU_ISA="SSE41", OMP_NUM_THREADS="1",
             MKL_NUM_THREADS="1"),
        dict(ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2", ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="2",
             MKL_NUM_THREADS="2"),
        dict(ATEN_CPU_CAPABILITY="avx512", MKL_CBWR="AUTO", ONEDNN_MAX_CPU_ISA="ALL", OMP_NUM_THREADS="2",
             MKL_NUM_THREADS="2"),
    ]  # fmt: skip
    assert all("-m numerics" in r["args"] for r in runs)


def test_side_by_side_runs_the_same_settings_and_fails_on_any_one(tmp_path: Path) -> None:
    """LTX_NUMERICS_SIDE_BY_SIDE=1: the same runs, printed in the order given, each per-test limit scaled by the
    settings sharing the cores (one run's 2-thread limit stays that run's alone); any failing setting fails the
    whole and is named."""
    settings = "default:1 avx2:2 avx512:2"
    alone, together = _environments(tmp_path, settings), _environments(tmp_path, settings, side_by_side=True)
    assert [{k: r[k] for k in _VARS} for r in together] == [{k: r[k] for k in _VARS} for r in alone]
    assert [r["args"].split("-o timeout=")[1].split()[0] for r in alone] == ["300", "600", "600"]
    assert [r["args"].split("-o timeout=")[1].split()[0] for r in together] == ["900", "1800", "1800"]
    failing = _run(tmp_path, settings, side_by_side=True, tail='[ "$ATEN_CPU_CAPABILITY" = avx2 ] && exit 3\nexit 0\n')
    assert failing.returncode == 1 and "failed under: avx2:2 (pytest exit 3)" in failing.stderr, failing.stderr


def test_ci_runs_the_oldest_paths_at_one_thread_and_avx2_at_two_side_by_side() -> None:
    line = 'LTX_NUMERICS_SIDE_BY_SIDE=1 LTX_NUMERICS_SETTINGS="default:1 avx2:2" bash scripts/test-numerics.sh'
    assert line in (ROOT / ".ci/run").read_text()
