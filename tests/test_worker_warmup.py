"""The warm-up follows the plan a client job gets, and an out-of-memory warm-up never costs the fleet: a real
`ltx-worker one` (CPU fleet, the fault runner, real Redis and S3) with injected out-of-memory errors.

Before: warm-up requests carried no `memory_plan`, and `_warm_up` turned any error into a failed build, so a
warm-up that ran out of memory discarded the healthy fleet, rebuilt it three times and exited 3, and the
supervisor restarted it after 1 s, for ever (a 1536x1024x241 warm-up on one H200).

The fleet, a worker-level unit (`WarmFleet` with a stand-in controller): the capacity it reports after setup
plans the warm-up before it runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import JobFleet as Worker
from tests.support.fleet import running_worker
from tests.support.runners import read_records
from tests.support.workers import wait_state

pytestmark = pytest.mark.timeout(240)

SMALL = {"width": 64, "height": 64, "num_frames": 9}
DROPPED = 'ltx_worker_warmup_dropped_total{group="cpu:1",reason="out_of_memory"}'


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("warm-records")
    return {"low": tmp / "low.jsonl", "oom": tmp / "oom.jsonl", "ok": tmp / "ok.jsonl"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any, records: Any) -> Any:
    warmup = [
        {"prompt": f"w error=oom_unless_low record={records['low']}", **SMALL},  # fits on the lower plan only
        {"prompt": f"w error=oom record={records['oom']}", **SMALL},  # out of memory on every plan
        {"prompt": f"w record={records['ok']}", **SMALL},
    ]
    with running_worker(tmp_path_factory.mktemp("warmup"), redis_server, s3_server, handle=Worker,
                        warmup_requests=json.dumps(warmup), max_rebuild_failures=1) as w:  # fmt: skip
        yield w


def test_a_warm_up_out_of_memory_retries_once_on_the_lower_plan_on_the_same_fleet(worker, records):
    health = worker.health()
    fleet = health["fleet"]
    starts = [r for r in read_records(records["low"]) if r["event"] == "start"]
    # the plan a job of that size gets (the runner's default: no capacity on a CPU fleet), then the lower one
    assert [s["memory_plan"] for s in starts] == [None, {"decode_chunked": True, "release_between_stages": True}]
    assert {s["pid"] for s in starts} == set(fleet["pids"]), (starts, fleet)  # the same rank process, kept
    assert fleet["builds"] == 1 and fleet["rebuilds"] == 0, fleet  # (one failed build would have exited: 1 allowed)
    assert [r["event"] for r in read_records(records["ok"])] == ["start", "end"]  # the rest warmed up too


def test_a_warm_up_size_out_of_memory_twice_is_dropped_and_the_worker_serves(worker, records):
    fleet = worker.health()["fleet"]
    plans = [r["memory_plan"] for r in read_records(records["oom"]) if r["event"] == "start"]
    assert plans == [None, {"decode_chunked": True, "release_between_stages": True}], plans  # tried twice
    (dropped,) = fleet["startup"]["warmup_dropped"]
    assert dropped["index"] == 1 and dropped["reason"] == "out_of_memory" and dropped["size"] == "64x64x9"
    assert fleet["startup"]["warmup_jobs"] == 2, fleet["startup"]
    assert worker.metric(DROPPED) == 1
    log = worker.proc.log_tail(200_000)
    warnings = [line for line in log.splitlines() if "dropped (out_of_memory)" in line]
    assert len(warnings) == 1 and '"level": "WARNING"' in warnings[0], warnings
    job = worker.enqueue("t")
    assert wait_state(job, {"failed", "uploaded"}, 60, worker.proc) == "uploaded", job.get_meta(refresh=True)
    after = worker.health()["fleet"]
    assert after["pids"] == fleet["pids"] and after["builds"] == 1, after


# ==== the fleet, with a stand-in controller ===============================================================


class _Controller:
    """Starts (its rank stamps say 3 GiB offered after setup: `RankStartup.device_memory_bytes`) and renders
    warm-ups: out of memory unless the plan chunks the decode."""

    made: list[_Controller] = []

    def __init__(self, runner_cls: Any, devices: Any) -> None:
        self.pids, self.is_alive, self.jobs = [2**30], False, []
        _Controller.made.append(self)

    def start(self, timeout: float, **kwargs: Any) -> None:
        from ltx_mgpu.control.startup import FleetStartup, RankStartup

        t = time.time()
        self.is_alive, self.startup = True, FleetStartup(t, (RankStartup(0, 1, t, t, t, {}, 3 << 30),))

    def shutdown(self, graceful_timeout: float) -> None:
        self.is_alive = False

    def stream(self, timeout: float | None = None, **kwargs: Any) -> Any:
        from ltx_mgpu import RenderOutOfMemory, SymmetricRunnerError

        self.jobs.append(kwargs)
        if not (kwargs.get("memory_plan") or {}).get("decode_chunked"):
            raise SymmetricRunnerError([RenderOutOfMemory("CUDA out of memory (injected)")])
        yield {"type": "output"}


def test_the_capacity_reported_after_setup_plans_the_warm_up_like_a_job(tmp_path):
    """The fleet reports its capacity before the warm-up runs, and the render service's hook plans each warm-up
    request from it exactly as a client job of that size (`RenderService.memory_plans`): at 3 GiB the fast plan
    fits 256x256x121 (out of memory here: retried once on the lower plan), not 448x448x121 (its first attempt
    already takes the chunked decode), and 1024x1024x121 is refused by the plan, dropped unsent."""
    from types import SimpleNamespace

    from ltx_contract.limits import RunnerLimits
    from ltx_mgpu.spec import memory_plan
    from worker.render.fleet import WarmFleet
    from worker.render.service import RenderService

    _Controller.made = []
    sizes = [(256, 256, 121), (448, 448, 121), (1024, 1024, 121)]
    events: list[dict] = []
    warmup = [{"prompt": "w", "width": w, "height": h, "num_frames": f} for w, h, f in sizes]
    fleet = WarmFleet(object, ["cpu"], factory=_Controller, backoff_s=0, on_event=events.append, warmup=warmup,
                      warmup_dir=tmp_path)  # fmt: skip
    service = RenderService.__new__(RenderService)  # (only its planning: settings, limits, the fleet)
    service.settings, service.fleet, service.takes_memory_plan = SimpleNamespace(device_memory_gib=None), fleet, True
    memory = memory_plan.FleetMemory("distilled", 1, profile="tiny", headroom_gib=0.5)
    service._limits = RunnerLimits("fault", {}, memory)
    fleet.warm.plans = service.warmup_plans
    assert service.limits.memory.capacity_gib is None  # nothing measured before the fleet started

    fleet.start()
    (ctl,) = _Controller.made
    assert service.limits.memory.capacity_gib == 3.0  # from setup (the stand-in reports no warm-up memory)
    chunked = [(j["width"], j["memory_plan"]["decode_chunked"]) for j in ctl.jobs]
    assert chunked == [(256, False), (256, True), (448, True)], chunked
    assert [e["reason"] for e in events if e["action"] == "warmup_dropped"] == ["refused"]
    assert fleet.state == "ready" and fleet.builds == 1 and fleet.build_failures == 0
    assert fleet.startup["warmup_jobs"] == 2 and fleet.startup["warmup_dropped"][0]["size"] == "1024x1024x121"
