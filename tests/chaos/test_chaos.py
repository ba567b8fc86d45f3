"""The bounded CI chaos run: one fixed seed, every fault kind at least once, hostile input through every
door, then the invariant checker. Fails on any violated invariant (lost, duplicated, corrupt, leaked
processes, unbounded Redis memory), on a job that ended otherwise than its fault (or none) predicts, on a
fault the service did not survive, on a bad input that was not rejected, or on a step that stalled.

And the negative control: the same checker on a stack with a planted defect (no retry budget) must fail.
The long soak is `tests/chaos/soak.py`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.chaos.engine import FAULT_KINDS, run_chaos

pytestmark = pytest.mark.timeout(600)

SEED = 20240607
#: Jobs in the CI run: the faults' own (20 for 2 of each kind), 37 normal ones spread between the faults, a probe
#: and two canaries. (45 jobs ran no faster: the faults' waits, not the renders, take the time.)
JOBS = 60


def test_chaos_ci(tmp_path: Any, s3_server: Any, redis_server: Any) -> None:
    del redis_server  # (only to fail early when redis-server is missing; the run starts its own with AOF)
    events: list[dict[str, Any]] = []
    report, verdict = run_chaos(tmp_path, seed=SEED, jobs=JOBS, faults=2 * len(FAULT_KINDS), bad_inputs=30,
                                s3=s3_server, settle_timeout=150, log=events.append)  # fmt: skip
    print(report.line(), f"({report.seconds}s)")
    violations = {k: report.details.get(k) for k in ("unexpected", "lost", "duplicated", "corrupt", "leaked",
                                                     "memory", "stalled", "error", "not_rejected", "unsettled_after_s")
                  if report.details.get(k)}  # fmt: skip
    print("violations:", json.dumps(violations, default=str)[:6000])  # (first: the summary below is long)
    summary = json.dumps({"details": report.details, "events": events}, default=str, indent=1)[:20000]
    # each kind twice: one whose target never reached the state to hit (a worker held back) has a second chance
    assert report.details.get("injected") == sorted(FAULT_KINDS) and report.jobs >= JOBS - 5, summary
    assert report.unexpected == 0 and not verdict.unexpected, summary
    assert report.lost == 0 and report.duplicated == 0 and report.corrupt == 0, summary
    assert report.leaked == 0 and report.stalled == 0, summary
    assert not verdict.memory, summary
    assert report.bad_inputs >= 30 and report.rejected == report.bad_inputs, summary
    assert report.survived == report.faults, summary
    assert report.ok, summary


def test_chaos_checker_fails_on_a_planted_defect(tmp_path: Any, s3_server: Any, redis_server: Any) -> None:
    """Negative control (a report once listing a job as `failed (expected uploaded)` still said ok).
    With every retry budget at 0, a rank killed mid-render fails its job for good: the checker must count
    it as unexpected, on the report line, and the seed must not be ok."""
    del redis_server
    no_retries = {"retry_fleet_failure": 0, "retry_worker_lost": 0, "retry_upload_failed": 0}
    report, verdict = run_chaos(tmp_path, seed=7, jobs=6, faults=2, bad_inputs=0, s3=s3_server, settle_timeout=120,
                                fault_kinds=("kill_rank",), worker_settings=no_retries)  # fmt: skip
    summary = json.dumps(report.details, default=str)[:8000]
    assert report.faults == 2 and report.stalled == 0, summary
    assert report.unexpected >= 2 and len(verdict.unexpected) == report.unexpected, summary
    assert all("kill_rank" in line and "expected uploaded" in line for line in verdict.unexpected), summary
    assert f"unexpected {report.unexpected}," in report.line()
    assert report.survived == 0 and not report.ok
