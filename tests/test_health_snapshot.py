"""The health snapshot as a typed protocol object (`ltx_contract.health`): what a worker writes reads
back the same on the producer's side, older and newer snapshots still parse, and a malformed one reaches
the producer as one line naming the field (real Redis for the producer; the writer's side of a real worker
is checked by every worker test through `tests.support.workers.worker_health`)."""

from __future__ import annotations

import json

import pytest
from rq import Queue
from rq.worker import Worker

from ltx_contract.handoff import HandOff
from ltx_contract.health import FleetHealth, LoraOffer, SnapshotError, UploadsHealth, WorkerHealth, read_health
from ltx_contract.keys import worker_health_key
from tests.support.cli import run

#: A snapshot as `worker.runtime.fleet_worker` writes it (every key, in its order).
SNAPSHOT = {
    "worker": "ltx-cpu.abc123", "group": "cpu:2", "queues": ["ltx"], "runner": "smoke",
    "limits": {"runner": "smoke", "ranges": {"num_inference_steps": [1, 50]}},
    "loras": {"names": ["dolly"], "s3_prefixes": ["loras/u/"], "max_per_request": 4, "shared_prefixes": [],
              "per_tenant": False},
    "fleet": {"state": "ready", "alive": True, "pids": [101, 102], "world_size": 2, "devices": ["cpu", "cpu"],
              "builds": 1, "rebuilds": 0, "failures": 0, "ready_at": 1700000000.5, "last_failure": None,
              "startup": {"started_at": 1699999999.0, "ready_s": 1.5}},
    "current_job": None,
    "uploads": {"pending": 0, "encoding": 0, "pending_bytes": 0, "in_flight": 0, "full": False, "max_pending": 8,
                "max_pending_bytes": 1 << 30, "uploaded": 3, "failed": 0, "backpressure": False,
                "backpressure_reason": None, "background": True},
    "storage": {"state": "ok", "error": None},
    "redis": {"up": True, "since": None, "reason": None, "outages": 0},
    "jobs_done": 3, "metrics_port": 9100, "pid": 4242, "process_started_at": 1699999998.0, "ts": 1700000001.25,
}  # fmt: skip


def test_json_round_trips_key_for_key_and_in_order() -> None:
    health = WorkerHealth.from_json(json.loads(json.dumps(SNAPSHOT)))
    assert health.fleet is not None and health.fleet.pids == (101, 102) and health.uploads.max_pending == 8
    assert health.loras == LoraOffer(("dolly",), ("loras/u/",), 4)
    assert json.dumps(health.to_json()) == json.dumps(SNAPSHOT)  # same keys, same order, same values
    assert health.runner_limits() is not None and health.runner_limits().ranges["num_inference_steps"] == (1.0, 50.0)


def test_built_snapshot_reads_back_equal() -> None:
    built = WorkerHealth(worker="w", queues=("q",), fleet=FleetHealth(state="starting", pids=(7,)),
                         uploads=UploadsHealth(pending=2, backpressure=True), jobs_done=0, ts=1.0)  # fmt: skip
    assert read_health(json.dumps(built.to_json())) == built


def test_older_and_newer_snapshots_parse() -> None:
    older = WorkerHealth.from_json({"worker": "w", "fleet": {"state": "ready"}})
    assert older.uploads is None and older.jobs_done is None and older.fleet.pids == () and older.limits is None
    newer = WorkerHealth.from_json({**SNAPSHOT, "gpu_temp": 71, "fleet": {**SNAPSHOT["fleet"], "nvlink": True}})
    assert newer.to_json() == SNAPSHOT  # unknown keys are ignored
    assert read_health(None) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"fleet": {"pids": "101"}}', "health.fleet.pids: expected a list, got str '101'"),
        ('{"fleet": {"pids": [1, "x"]}}', "health.fleet.pids[1]: expected int, got str 'x'"),
        ('{"jobs_done": true}', "health.jobs_done: expected int, got bool 'True'"),
        ('{"uploads": 3}', "health.uploads: expected an object, got int '3'"),
        ("[1]", "health: expected an object, got list '[1]'"),
        ("{not json", "health: not JSON (Expecting property name enclosed in double quotes: line 1 column 2"),
    ],
)
def test_malformed_snapshot_names_the_field_in_one_line(raw: str, message: str) -> None:
    with pytest.raises(SnapshotError) as err:
        read_health(raw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_producer_stats_reports_a_malformed_snapshot_in_one_line(env, redis_client) -> None:
    queue = Queue(env["LTX_QUEUES"], connection=redis_client)
    good = Worker([queue], connection=redis_client, name=f"good-{env['LTX_QUEUES']}")
    bad = Worker([queue], connection=redis_client, name=f"bad-{env['LTX_QUEUES']}")
    for worker in (good, bad):
        worker.register_birth()
    redis_client.set(worker_health_key(good.name), json.dumps(SNAPSHOT), ex=60)
    redis_client.set(worker_health_key(bad.name), json.dumps({**SNAPSHOT, "fleet": {"pids": "101"}}), ex=60)
    try:
        code, out, err = run(["stats"], env)
        assert code == 0 and "Traceback" not in out + err, (out, err)
        lines = [line for line in out.splitlines() if "unreadable" in line]
        assert lines == [f"worker {bad.name}: health snapshot unreadable: health.fleet.pids: expected a list, "
                         "got str '101'"], out  # fmt: skip
        code, out, _ = run(["stats", "--json"], env)
        workers = {w["name"]: w for w in json.loads(out)["workers"]}
        assert code == 0 and workers[good.name]["health"] == SNAPSHOT and workers[good.name]["fleet_state"] == "ready"
        assert workers[bad.name]["health"] is None and "fleet.pids" in workers[bad.name]["health_error"]
    finally:
        for worker in (good, bad):
            worker.register_death()
            redis_client.delete(worker_health_key(worker.name))


# ==== the hand-off result (ltx_contract.handoff) ======================================================


@pytest.mark.parametrize(
    "stored",
    [
        {"job_id": "j1", "state": "rendering", "encode": "pending", "upload": "pending", "render_s": 1.25,
         "worker": "w"},
        {"job_id": "j1", "state": "rendered", "upload": "pending", "key": "videos/j1.mp4", "bytes": 300000,
         "render_s": 1.25, "worker": "w"},
    ],
)  # fmt: skip
def test_handoff_json_round_trips_key_for_key_and_in_order(stored: dict) -> None:
    handoff = HandOff.read(json.loads(json.dumps(stored)))
    assert handoff is not None and json.dumps(handoff.to_json()) == json.dumps(stored)


def test_only_a_handoff_reads_as_one() -> None:
    uploaded = {"job_id": "j1", "state": "uploaded", "key": "k", "sha256": "ab" * 32, "bytes": 3}
    assert HandOff.read(uploaded) is None and HandOff.read(None) is None and HandOff.read("pending") is None
    assert HandOff.read({"upload": "pending", "state": "rendered"}) is None  # no job id: not one we wrote
    with pytest.raises(SnapshotError, match=r"^hand-off\.job_id: missing$"):
        HandOff.from_json({"state": "rendered"})
    with pytest.raises(SnapshotError, match=r"^hand-off\.bytes: expected int, got str"):
        HandOff.from_json({"job_id": "j", "state": "rendered", "bytes": "3"})
