"""Resume a test run across calls: tests that passed at this tree are not run again.

Why: a GPU session has about 30 minutes of device time and one call runs at most 10, while the GPU suite takes
about 15 minutes of it on an H100. Split by hand over several calls, the split's guesses re-ran tests that had
already passed (2.5 minutes of one session's device time re-ran `test_ltx2_runners_gpu.py` cases). With
`LTX_TEST_RESUME_FILE` set, every outcome is appended to that file as it happens, with its seconds (setup and
call: what a split of the suite needs), so a call stopped by its time limit keeps what finished; the next run
with the same file deselects what passed, and `bash scripts/gpu_session.sh tests` is simply called again until
nothing is left. Failures run again (the call after a fix is the one that shows it), and so do skips: they cost
nothing, and a skip for a missing wheel or server must run once a later call has installed it.

A machine lent for a device call is given back when idle or after 30 minutes held, and its /tmp goes with it.
`LTX_TEST_RESUME_SEED` names a file of earlier outcomes carried in from another machine (the `$OUT` copy of the
record a previous call sent back): its lines of this tree are put ahead of the record's own at start, so the
record's own, newer, outcomes win and the record carries the seed's on to the next copy.

Outcomes count only for the tree they were recorded at: the file stores a fingerprint of every source file
(names and bytes of the .py, CUDA, C++ and .toml files under `LTX_TEST_RESUME_ROOT` or the repository, hidden
folders and build output left out), so a change to anything re-runs everything. pytest's own cache (`--lf`,
`--sw`) keys on nothing of the sort, and the device sessions run with `-p no:cacheprovider`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["FILE_ENV", "ROOT_ENV", "SEED_ENV", "ResumePlugin", "fingerprint", "read_outcomes", "register", "seed"]

FILE_ENV = "LTX_TEST_RESUME_FILE"
ROOT_ENV = "LTX_TEST_RESUME_ROOT"
SEED_ENV = "LTX_TEST_RESUME_SEED"
_SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".h", ".hpp", ".toml"}
_SKIP_DIRS = {"__pycache__", "build", "_skbuild", "node_modules"}  # (and every hidden one: .git, .venv, .whl*)
_DONE = ("passed",)


def _sources(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (d in _SKIP_DIRS or d.startswith(".") or d.endswith(".egg-info")))
        for name in sorted(files):
            if Path(name).suffix in _SUFFIXES:
                yield Path(folder) / name


def fingerprint(root: Path) -> str:
    """A digest of every source file's path (relative to `root`) and bytes."""
    digest = hashlib.sha256()
    for path in _sources(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def read_outcomes(path: Path, tree: str) -> dict[str, str]:
    """nodeid -> the last outcome recorded at `tree` (lines of "tree outcome seconds nodeid")."""
    outcomes: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[0] == tree:
                outcomes[parts[3]] = parts[1]
    return outcomes


def seed(path: Path, source: Path, tree: str) -> int:
    """Put `source`'s lines recorded at `tree` ahead of `path`'s own (which, later in the file, win); returns how
    many were added. Lines `path` already holds are not repeated, so seeding twice changes nothing."""
    if not source.exists():
        return 0
    own = path.read_text().splitlines() if path.exists() else []
    present = set(own)
    carried = [line for line in source.read_text().splitlines() if line.startswith(f"{tree} ") and line not in present]
    if carried:
        path.write_text("".join(f"{line}\n" for line in (*carried, *own)))
    return len(carried)


class ResumePlugin:
    """Deselects what passed at this tree; records each outcome as it happens."""

    def __init__(self, path: Path, root: Path, seed_from: Path | None = None) -> None:
        self.path = path
        self.tree = fingerprint(root)
        self.seeded = seed(path, seed_from, self.tree) if seed_from is not None else 0
        self.known = read_outcomes(path, self.tree)
        self._setup_s: dict[str, float] = {}  # (a test's setup seconds, its fixtures', until its call is recorded)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        done = [item for item in items if self.known.get(item.nodeid) in _DONE]
        if done:
            items[:] = [item for item in items if self.known.get(item.nodeid) not in _DONE]
            config.hook.pytest_deselected(items=done)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            carried = f", {self.seeded} outcomes carried in" if self.seeded else ""
            reporter.write_line(
                f"resume ({self.path}, tree {self.tree}{carried}): {len(done)} passed before, {len(items)} to run"
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "setup":
            self._setup_s[report.nodeid] = report.duration
        if report.when == "call" or report.outcome != "passed":  # (setup and teardown only when they fail/skip)
            outcome = "passed" if report.passed else "skipped" if report.skipped else "failed"
            seconds = report.duration + (self._setup_s.pop(report.nodeid, 0.0) if report.when == "call" else 0.0)
            with self.path.open("a") as f:  # (one line at a time, flushed: a killed run keeps what finished)
                f.write(f"{self.tree} {outcome} {seconds:.1f} {report.nodeid}\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        outcomes = read_outcomes(self.path, self.tree)
        tally = {name: sum(1 for o in outcomes.values() if o == name) for name in ("passed", "skipped", "failed")}
        failed = sorted(k for k, o in outcomes.items() if o == "failed")
        terminalreporter.write_line(
            f"resume: at tree {self.tree}, over every run so far: {tally['passed']} passed, {tally['skipped']} "
            f"skipped, {tally['failed']} failed" + (f": {', '.join(failed)}" if failed else "")
        )


def register(config: pytest.Config) -> None:
    """`ResumePlugin` on `config` when `LTX_TEST_RESUME_FILE` is set (tests/conftest.py calls this)."""
    path = os.environ.get(FILE_ENV)
    if path:
        root = Path(os.environ.get(ROOT_ENV) or Path(__file__).resolve().parents[2])
        seed_from = os.environ.get(SEED_ENV)
        plugin = ResumePlugin(Path(path), root, Path(seed_from) if seed_from else None)
        config.pluginmanager.register(plugin, "ltx-resume")
