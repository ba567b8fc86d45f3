"""`tests.support.resume`: a run with `LTX_TEST_RESUME_FILE` leaves out what passed before at the same tree,
runs failures and skips again, keeps what finished when it is killed, and runs everything once a source changes
(how `scripts/gpu_session.sh tests` spreads the GPU suite over device calls)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_ROOT = Path(__file__).resolve().parent.parent

_TESTS = """
import os, signal, pytest
from pathlib import Path

def test_a():
    pass

def test_b():
    assert Path(os.environ["FIXED"]).exists()

@pytest.mark.skip(reason="not here")
def test_c():
    pass

def test_d():
    if os.environ.get("KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
"""

_CONFTEST = """
def pytest_configure(config):
    from tests.support.resume import register
    register(config)
"""


def _run(src: Path, record: Path, fixed: Path, **env: str) -> tuple[int, str]:
    environ = {**os.environ, "PYTHONPATH": str(_ROOT), "LTX_TEST_RESUME_FILE": str(record),
               "LTX_TEST_RESUME_ROOT": str(src), "FIXED": str(fixed), **env}  # fmt: skip
    environ.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(src)],
        cwd=src, env=environ, capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_a_resumed_run_runs_only_what_has_not_passed_at_this_tree(tmp_path: Path) -> None:
    src, record, fixed = tmp_path / "src", tmp_path / "outcomes.txt", tmp_path / "fixed"
    src.mkdir()
    (src / "test_x.py").write_text(_TESTS)
    (src / "conftest.py").write_text(_CONFTEST)

    rc, out = _run(src, record, fixed, KILL="1")  # killed in test_d: a, b and c are on record
    assert rc != 0 and "PASSED" not in out.split("test_d")[-1]
    lines = [line.split(" ", 3) for line in record.read_text().splitlines()]
    assert [[outcome, nodeid] for _, outcome, _, nodeid in lines] == [
        ["passed", "test_x.py::test_a"], ["failed", "test_x.py::test_b"], ["skipped", "test_x.py::test_c"],
    ]  # fmt: skip
    assert all(float(seconds) >= 0 for _, _, seconds, _ in lines)

    rc, out = _run(src, record, fixed)  # b fails again (failures run again), c and d run, a does not
    assert rc == 1 and "1 passed before, 3 to run" in out
    assert "PASSED test_x.py::test_d" in out and "FAILED test_x.py::test_b" in out and "test_x.py::test_a" not in out
    assert "over every run so far: 2 passed, 1 skipped, 1 failed: test_x.py::test_b" in out

    fixed.touch()  # the fix (outside the fingerprinted sources, like a server a test needs)
    rc, out = _run(src, record, fixed)
    assert rc == 0 and "2 passed before, 2 to run" in out and "PASSED test_x.py::test_b" in out
    assert "3 passed, 1 skipped, 0 failed" in out

    rc, out = _run(src, record, fixed)  # only the skip is left: it runs again, and skips
    assert rc == 0 and "3 passed before, 1 to run" in out and "SKIPPED" in out and "PASSED" not in out

    (src / "test_x.py").write_text(_TESTS + "\n# a change\n")  # another tree: everything runs again
    rc, out = _run(src, record, fixed)
    assert rc == 0 and "0 passed before, 4 to run" in out and out.count("PASSED") == 3


def test_outcomes_carried_in_from_another_machine_count_and_the_record_carries_them_on(tmp_path: Path) -> None:
    """A fresh machine's record starts from the seed's lines of this tree (an earlier machine's `$OUT` copy):
    what passed there is left out here, the record then holds the seed's lines too (so its own copy carries them
    to the next machine), and the record's own, later, outcomes win over the seed's."""
    src, record, fixed, carried = tmp_path / "src", tmp_path / "outcomes.txt", tmp_path / "fixed", tmp_path / "in.txt"
    src.mkdir()
    (src / "test_x.py").write_text(_TESTS)
    (src / "conftest.py").write_text(_CONFTEST)
    earlier = tmp_path / "earlier.txt"
    rc, out = _run(src, earlier, fixed, KILL="1")  # the earlier machine: a passed, b failed, c skipped, then killed
    carried.write_text(earlier.read_text() + "0123456789abcdef passed 1.0 test_x.py::test_d\n")  # (another tree)
    fixed.touch()
    rc, out = _run(src, record, fixed, LTX_TEST_RESUME_SEED=str(carried))
    assert rc == 0 and "3 outcomes carried in): 1 passed before, 3 to run" in out, out
    assert "test_x.py::test_a" not in out and "PASSED test_x.py::test_b" in out and "PASSED test_x.py::test_d" in out
    assert "3 passed, 1 skipped, 0 failed" in out  # b's own pass wins over the seed's failure
    lines = record.read_text().splitlines()
    assert lines[:3] == earlier.read_text().splitlines() and not any(x.startswith("0123") for x in lines)
    rc, out = _run(src, record, fixed, LTX_TEST_RESUME_SEED=str(carried))  # seeding again adds nothing
    assert rc == 0 and "carried in" not in out and "3 passed before, 1 to run" in out
