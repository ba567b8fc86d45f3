"""Scripts under scripts/ as the environment shapes them, run with a stand-in interpreter (no stack starts).

`scripts/fresh_starts.sh` made its work folder with `mktemp -d /tmp/...`: a `TMPDIR` pointing elsewhere (a
bigger disk, a per-user folder, a sandbox without /tmp) was ignored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fresh_starts_makes_its_work_folder_under_tmpdir(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    calls = tmp_path / "calls"
    fake = tmp_path / "python"  # (records its arguments, then runs the real interpreter)
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHON": str(fake)}
    script = ROOT / "scripts" / "fresh_starts.sh"
    done = subprocess.run(["bash", str(script), "0"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "0/0 ready" in done.stdout, done.stdout + done.stderr
    results = [line for line in calls.read_text().splitlines() if line.endswith("/results.jsonl")]
    assert results and all(Path(r).parent.parent == tmpdir for r in results), calls.read_text()
    assert list(tmpdir.iterdir()) == []  # (and removed on exit)
