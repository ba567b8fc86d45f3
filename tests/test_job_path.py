"""A job's path has one owner and stays short (`tests/support/job_walk.py` measures it).

Whatever finds how an attempt ended returns it as a value (`worker.jobs.ends`), and the attempt alone decides and
records it: one call in the whole worker ends a job by raising, the job function's `attempt.conclude` (27 calls
did, from helpers of the service, the drive of the fleet and the attempt's own callers). And the walk of one job
from `RenderService.run_job` to its hand-off to the stages is held to what it is now: 14 worker modules, 84
module changes, 63 functions holding 83 `return` statements (before the attempt owned its end: 16 modules, 124
changes, 69 functions, 85 returns). A change that lengthens the path raises these bounds on purpose, or fails here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.job_walk import raised_ends, walk

ROOT = Path(__file__).resolve().parent.parent

#: The walk's bounds (module docstring): modules, module changes, functions, returns.
MODULES, VISITS, FUNCTIONS, RETURNS = 14, 84, 63, 83


def test_only_the_attempt_ends_a_job_by_raising(tmp_path: Path) -> None:
    assert raised_ends(ROOT) == 1  # (`RenderService.run_job`: `attempt.conclude(self._run(...))`)
    shutil.copytree(ROOT / "worker", tmp_path / "worker")
    with (tmp_path / "worker" / "render" / "fleet_render.py").open("a") as f:
        f.write("\n\ndef _planted(attempt):\n    attempt.conclude(None)  # a helper ending the job itself\n")
    assert raised_ends(tmp_path) == 2


@pytest.mark.timeout(240)
def test_the_walk_from_run_job_to_the_hand_off_stays_short(redis_server: Any, tmp_path: Path) -> None:
    measured = walk(redis_server.url, tmp_path)
    assert measured.path[0] == "worker.render.service" and measured.path[-1] == "worker.job"  # (the whole walk)
    bounds = {"modules": MODULES, "visits": VISITS, "functions": FUNCTIONS, "returns": RETURNS}
    over = {k: (getattr(measured, k), bound) for k, bound in bounds.items() if getattr(measured, k) > bound}
    assert not over, f"the job's walk grew (measured, bound): {over}; per module: {measured.per_module}"
