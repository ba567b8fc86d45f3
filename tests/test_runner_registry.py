"""Every runner name a worker knows out of the box resolves to an MGPURunner class (imports included)."""

from __future__ import annotations

import pytest

from ltx_mgpu import MGPURunner
from worker.settings import BUILTIN_RUNNERS, WorkerSettings, resolve_runner


@pytest.mark.parametrize("name", sorted(BUILTIN_RUNNERS))
def test_builtin_runner_resolves(name: str) -> None:
    cls = resolve_runner(WorkerSettings(runner=name))
    assert isinstance(cls, type) and issubclass(cls, MGPURunner)


def test_ltx2_runners_are_registered() -> None:
    assert {"smoke", "ltx2-distilled", "ltx2-two-stage"} <= set(BUILTIN_RUNNERS)
