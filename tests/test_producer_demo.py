"""The README's main command (`ltx-demo`, what `bash scripts/demo.sh` runs after setup), in a fresh clone.

The clone contains only committed files, so this also proves that everything the demo needs is in the
repository. Setup is skipped (this interpreter already has the dependencies); the clone's own code is used
through PYTHONPATH, in the demo and in every process it starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_renders_uploads_verifies_and_leaves_nothing_running(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if shutil.which("git") is None:
        pytest.skip("git not available")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    # Everything the demo and its servers write to TMPDIR must be gone after. A short path of its own, not under
    # tmp_path: SeaweedFS puts a Unix socket in it, and a socket path has at most 107 bytes (pytest-xdist's
    # `popen-gwN/` level made tmp_path's too long).
    tmpdir = Path(tempfile.mkdtemp(prefix="ltx-demo-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmpdir, ignore_errors=True))
    env = {**os.environ, "PYTHONPATH": str(clone), "TMPDIR": str(tmpdir)}
    env.pop("LTX_REDIS_URL", None)
    work = tmp_path / "cwd"
    work.mkdir()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "devstack.demo", "--output-dir", str(work / "out")],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # the producer's watch ran and the video reached the bucket
    assert "$ producer submit --watch examples/prompt.json" in log
    assert re.search(r"uploaded s3://videos/\S+/video\.mp4", log), log[-3000:]
    assert re.search(r"object:\s+s3://videos/\S+ \(\d+ bytes, in the bucket\)", log)
    copy = re.search(r"local copy: (\S+\.mp4) \(sha256 ([0-9a-f]{64}) verified\)", log)
    assert copy and Path(copy.group(1)).is_file(), log[-3000:]
    assert "PyAV:       17 frames 128x96 h264" in log
    assert re.search(r"audio:      aac 24000 Hz stereo, \d+\.\d\d s", log), log[-3000:]  # the mp4 has its sound
    # nothing left behind (the demo tracks every descendant and says so)
    assert re.search(r"all \d+ processes stopped", log), log[-3000:]
    assert "WARNING" not in log
    # ... and nothing left in TMPDIR: weed's logs and sockets used to stay (they now go to the server's folder)
    assert not any(tmpdir.iterdir()), sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*"))
    stopped = {m.group(1): float(m.group(2)) for m in re.finditer(r"stopped (\w+) in ([\d.]+)s", log)}
    assert stopped.get("s3", 99) < 8, log[-2000:]  # (the demo used to wait up to 15 s for weed)
    # (how long it took is reported, not judged: speed is a benchmark's business, and a slower or busier machine
    # than this one must not fail it; the subprocess timeout above is the hang guard)
    print(f"the demo took {elapsed:.0f}s")
    # docs/producer.md shows these lines with the hash left out: the bytes depend on the CPU's float kernels
    # and thread counts (its "Reproducible renders"), so a pinned sha256 held on one machine only. The
    # lines themselves are kept in step: the demo's output has the shape the docs show.
    docs = (ROOT / "docs" / "producer.md").read_text()
    assert "(sha256 <64 hex digits> verified)" in docs and "sha256 <first 16 hex digits>…)" in docs
    assert re.search(r"uploaded s3://videos/\S+ \([^)]+, sha256 [0-9a-f]{16}…\)", log), log[-3000:]
