"""Test tiers: every test has exactly one (`tests.support.tiers.tier_of`, applied in tests/conftest.py), the
README's command (`bash scripts/test.sh`) selects the fast ones, and `.ci/run` runs that command and then its
complement, so no test is left out of CI whatever tier it lands in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiers import FAST, TIERS, fast_expression, tier_of

ROOT = Path(__file__).resolve().parents[1]
T = ROOT / "tests"


@pytest.mark.parametrize(
    ("path", "fixtures", "markers", "tier"),
    [
        (T / "chaos" / "test_chaos.py", ["redis_server"], [], "chaos"),
        (T / "test_sp_gpu.py", [], [], "gpu"),
        (T / "test_media.py", [], ["gpu"], "gpu"),
        (T / "test_structure.py", [], [], "meta"),
        (T / "test_producer_cli.py", ["tmp_path", "redis_url", "redis_server"], [], "integration"),
        (T / "test_worker_units.py", ["tmp_path"], [], "integration"),
        (T / "test_media.py", ["tmp_path"], ["numerics"], "unit"),
    ],
)
def test_tier_of(path: Path, fixtures: list[str], markers: list[str], tier: str) -> None:
    assert tier_of(path, fixtures, markers) == tier


def test_every_tier_is_registered_and_fast_is_a_subset() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert all(f'"{tier}: ' in text for tier in TIERS)
    assert set(FAST) < set(TIERS)


def _selections(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """Run scripts/test.sh with a stand-in interpreter that prints the pytest arguments it was given."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LTX_TEST")}, **env}
    env.update(PYTHON_BIN=str(fake), LTX_TEST_SKIP_SETUP="1")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    args = out.splitlines()
    assert args[:2] == ["-m", "pytest"]
    return args[2:]


def test_the_script_selects_the_fast_tiers_the_rest_or_all(tmp_path: Path) -> None:
    fast = fast_expression()
    default = _selections(tmp_path)
    assert default[default.index("-m") + 1] == fast
    assert ["--dist", "loadfile"] == default[default.index("--dist") :][:2]
    rest = _selections(tmp_path, "--rest", "tests/test_x.py")
    assert rest[rest.index("-m") + 1] == f"not ({fast})" and rest[-1] == "tests/test_x.py"
    assert "-m" not in _selections(tmp_path, "--all")
    named = _selections(tmp_path, LTX_TEST_TIERS="chaos  integration")
    assert named[named.index("-m") + 1] == "chaos or integration"


def test_the_script_fails_when_no_test_ran(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 5\n")  # pytest's "no tests collected"
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON_BIN": str(fake), "LTX_TEST_SKIP_SETUP": "1"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1 and "no tests" in done.stderr


def test_ci_runs_the_readme_command_then_the_rest() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nbash scripts/test.sh    #" in (ROOT / "README.md").read_text()  # the README's command, no arguments
    first, rest = ci.index("\nbash scripts/test.sh\n"), ci.index("\nbash scripts/test.sh --rest\n")
    assert first < rest


def test_conftest_marks_each_test_before_m_deselects() -> None:
    """A tier expression selects by the hook's markers (`tier_of` gives every test exactly one)."""
    files = ["tests/test_tiers.py", "tests/test_sp_gpu.py", "tests/test_worker_limits.py"]
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    done = subprocess.run([*command, "-m", "meta or gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line} == set(files[:2]), done.stdout
