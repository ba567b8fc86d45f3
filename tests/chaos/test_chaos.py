"""The bounded CI chaos run: one fixed seed, every fault kind at least once, hostile input through every
door, then the invariant checker. Fails on any violated invariant (lost, duplicated, corrupt, leaked
processes, unbounded Redis memory), on a fault the service did not survive, or on a bad input that was not
rejected. The long soak is `bench/chaos.py`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.chaos.engine import FAULT_KINDS, run_chaos

pytestmark = pytest.mark.timeout(420)

SEED = 20240607


def test_chaos_ci(tmp_path: Any, s3_server: Any, redis_server: Any) -> None:
    del redis_server  # (only to fail early when redis-server is missing; the run starts its own with AOF)
    events: list[dict[str, Any]] = []
    report, verdict = run_chaos(tmp_path, seed=SEED, jobs=60, faults=2 * len(FAULT_KINDS), bad_inputs=30,
                                s3=s3_server, settle_timeout=150, log=events.append)  # fmt: skip
    print(report.line(), f"({report.seconds}s)")
    summary = json.dumps({"details": report.details, "events": events}, default=str, indent=1)[:20000]
    assert report.faults >= len(FAULT_KINDS) and report.jobs >= 55
    assert report.lost == 0 and report.duplicated == 0 and report.corrupt == 0, summary
    assert report.leaked == 0, summary
    assert not verdict.memory, summary
    assert report.bad_inputs >= 30 and report.rejected == report.bad_inputs, summary
    assert report.survived == report.faults, summary
    assert not verdict.unexpected, summary
