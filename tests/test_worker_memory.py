"""The memory plan in a real worker (`ltx-worker one --group cpu:1`, real Redis, real S3): a request that
cannot fit is refused before the fleet sees it (and `producer submit --dry-run` says the same from the
published limits); an out-of-memory render is retried once with the lower-memory plan on the same fleet.

Before: nothing said in advance whether a request fits; every size went to the fleet, and an out-of-memory
retry ran the very plan that had just failed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.exit_codes import ExitCode
from tests.support.cli import run, write
from tests.support.fleet import JobFleet as Worker
from tests.support.fleet import running_worker
from tests.support.runners import read_records
from tests.support.workers import enqueue, wait_rq_status, wait_state

pytestmark = pytest.mark.timeout(240)

REBUILDS = "ltx_worker_fleet_rebuilds_total"
LIMIT_GIB = 2.0  # the tiny profile's fleet holds ~0.1 GiB: 1024x1024x121 needs ~18 GiB to decode


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    with running_worker(tmp_path_factory.mktemp("memory"), redis_server, s3_server, handle=Worker,
                        runner_setup=json.dumps({"memory_profile": "tiny", "memory_request_loras": True}),
                        device_memory_gib=LIMIT_GIB, memory_headroom_gib=0.5, lora_max_per_request=3,
                        lora_max_rank=64) as w:  # fmt: skip
        yield w


def test_a_request_that_cannot_fit_is_refused_before_the_fleet_and_the_edge_says_the_same(worker, tmp_path):
    worker.idle()
    rebuilds, pids = worker.metric(REBUILDS), worker.health()["fleet"]["pids"]
    published = worker.health()["limits"]["memory"]
    assert published["capacity_gib"] == LIMIT_GIB and published["world_size"] == 1 and published["profile"] == "tiny"
    # the bound of a request's LoRAs is this worker's (LTX_LORA_MAX_*), not the runner's default
    assert (published["lora_tracker"], published["request_loras"], published["lora_max_rank"]) == (True, 3, 64)
    record = tmp_path / "rec.jsonl"
    request = {"prompt": f"t record={record}", "width": 1024, "height": 1024, "num_frames": 121}
    job = enqueue(worker.conn, worker.queue, request)
    assert wait_state(job, {"failed", "uploaded"}, 60, worker.proc) == "failed"
    wait_rq_status(job, {"failed"}, 60, worker.proc)
    meta = job.get_meta(refresh=True)
    error = meta["error"]
    assert error["reason"] == "invalid_request" and error["field"] == "size", error
    assert "over this fleet's limit of 1.5 GiB per device" in error["message"], error
    assert "largest that fits: 1024x1024x" in error["message"], error
    assert len(meta["attempts"]) == 1 and error["retryable"] is False
    assert not record.exists()  # the runner never saw it
    assert worker.metric(REBUILDS) == rebuilds and worker.health()["fleet"]["pids"] == pids

    # the edge, from what the worker published: the same words, exit 2, nothing enqueued
    path = write(tmp_path, "big.json", json.dumps(request))
    for args in (["submit", "--dry-run", path], ["submit", path]):
        code, _out, err = run(args, {"LTX_REDIS_URL": _url(worker), "LTX_QUEUES": worker.queue})
        assert code == ExitCode.USAGE and error["message"] in err, (args, err)
    assert Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer).count == 0

    # a request that fits renders, told the plan (the fast one: it fits with room)
    small = enqueue(worker.conn, worker.queue, {**request, "width": 64, "height": 64, "num_frames": 9})
    assert wait_state(small, {"failed", "uploaded"}, 60, worker.proc) == "uploaded"
    (start,) = [r for r in read_records(record) if r["event"] == "start"]
    assert start["memory_plan"]["decode_chunked"] is False and start["memory_plan"]["predicted_peak_gib"] > 0


def test_an_out_of_memory_render_is_retried_once_with_the_lower_memory_plan_on_the_same_fleet(worker, tmp_path):
    worker.idle()
    rebuilds, pids = worker.metric(REBUILDS), worker.health()["fleet"]["pids"]
    record = tmp_path / "rec.jsonl"
    job = worker.enqueue(f"t error=oom_unless_low record={record}")
    assert wait_state(job, {"failed", "uploaded"}, 90, worker.proc) == "uploaded", job.get_meta(refresh=True)
    meta = job.get_meta(refresh=True)
    assert [a["reason"] for a in meta["attempts"]] == ["out_of_memory"], meta["attempts"]
    plans = [r["memory_plan"] for r in read_records(record) if r["event"] == "start"]
    assert [p["decode_chunked"] for p in plans] == [False, True], plans
    assert plans[1]["release_between_stages"] is True
    assert worker.metric(REBUILDS) == rebuilds and worker.health()["fleet"]["pids"] == pids


def test_an_out_of_memory_retry_takes_a_strictly_lower_plan_and_the_lowest_is_not_retried(worker, tmp_path):
    """Before, the retry re-ran `plan(low_memory=True)`: for a size whose first plan was already the lower-memory
    one (the fast plan does not fit), that was the very plan that had just run out of memory. Now each retry
    steps down (`RenderService.memory_plans`), and a job whose lowest plan ran out of memory fails at once."""
    worker.idle()
    pids = worker.health()["fleet"]["pids"]
    record = tmp_path / "lowest.jsonl"
    # 384x256x121 at 1.5 GiB: the fast plan does not fit, so the job's first plan is already the lowest
    job = enqueue(worker.conn, worker.queue, {"prompt": f"t error=oom record={record}", "width": 384, "height": 256,
                                              "num_frames": 121})  # fmt: skip
    assert wait_state(job, {"failed", "uploaded"}, 60, worker.proc) == "failed"
    meta = job.get_meta(refresh=True)
    assert [a["reason"] for a in meta["attempts"]] == ["out_of_memory"], meta["attempts"]  # no second attempt
    assert meta["error"]["retryable"] is False and "lowest-memory plan ran out of memory" in meta["error"]["message"]
    assert [r["memory_plan"]["decode_chunked"] for r in read_records(record) if r["event"] == "start"] == [True]

    record = tmp_path / "steps.jsonl"  # a size whose fast plan fits: one step down, then no more
    job = worker.enqueue(f"t error=oom record={record}")
    assert wait_state(job, {"failed", "uploaded"}, 90, worker.proc) == "failed"
    meta = job.get_meta(refresh=True)
    assert [a["reason"] for a in meta["attempts"]] == ["out_of_memory"] * 2, meta["attempts"]
    plans = [r["memory_plan"] for r in read_records(record) if r["event"] == "start"]
    assert [(p["decode_chunked"], p["release_between_stages"]) for p in plans] == [(False, False), (True, True)]
    assert "not retried" in meta["error"]["message"] and meta["error"]["retryable"] is False, meta["error"]
    assert worker.health()["fleet"]["pids"] == pids


def _url(worker: Worker) -> str:
    kw = worker.conn.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def test_an_out_of_memory_error_in_a_driver_only_stage_is_an_out_of_memory_job(tmp_path, redis_server, s3_server):
    """The driver's own stages (audio decode, mux) run after the other ranks finished: the controller ends
    the job asymmetrically. Before, the worker failed it as `asymmetric_runner_error` (a runner bug, never
    retried); it is an out-of-memory job like any other (retried once, the fleet untouched)."""
    with running_worker(tmp_path, redis_server, s3_server, handle=Worker, group="cpu:2") as worker:
        pids = worker.health()["fleet"]["pids"]
        job = worker.enqueue("t error=oom_tail")
        assert wait_state(job, {"failed", "uploaded"}, 90, worker.proc) == "failed"
        meta = job.get_meta(refresh=True)
        assert meta["error"]["reason"] == "out_of_memory", meta["error"]
        assert meta["error"]["message"] == (
            "OutOfMemoryError: injected oom in the driver's mux (the lowest-memory plan ran out of memory: not retried)"
        ), meta["error"]
        assert [a["reason"] for a in meta["attempts"]] == ["out_of_memory"] * 2
        ok = worker.enqueue("t")
        assert wait_state(ok, {"failed", "uploaded"}, 60, worker.proc) == "uploaded"
        assert worker.metric(REBUILDS) == 0 and worker.health()["fleet"]["pids"] == pids


def test_a_warm_up_request_the_plan_refuses_stops_the_worker_at_start(tmp_path):
    """A warm-up renders after every fleet start: one that cannot fit failed every build (out of memory on a
    GPU, the token budget anywhere) until the worker gave up. Now it is a configuration error at start."""
    from tests.support.runners import RUNNERS
    from worker.runtime.process import build_worker
    from worker.settings import SettingsError, load_settings

    settings = load_settings(
        runners=RUNNERS,
        runner="fault",
        runner_setup={"memory_profile": "tiny"},
        device_memory_gib=LIMIT_GIB,
        memory_headroom_gib=0.5,
        storage_backend="local",
        local_storage_dir=str(tmp_path / "store"),
        spool_dir=str(tmp_path / "spool"),
        warmup_requests=[{"prompt": "w", "width": 1024, "height": 1024, "num_frames": 121}],
    )
    with pytest.raises(SettingsError, match=r"LTX_WARMUP_REQUESTS\[0\] is refused .* largest that fits"):
        build_worker(settings, "cpu:1")
