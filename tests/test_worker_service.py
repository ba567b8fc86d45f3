"""The render service end to end: real Redis, real S3 (SeaweedFS), real `ltx-worker one` processes with
CPU fleets (world 2, gloo) running the smoke runner or the fault-injection runner.

One module-scoped worker serves most tests (a fleet start costs seconds); its S3 traffic goes through a
`TcpProxy` so a test can make storage unreachable. Tests run in file order but do not depend on it:
each waits for the worker to be idle with a live fleet first.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from ltx_contract.control import cancel_job
from tests.support.fleet import Fleet, metric, running_worker, start_worker
from tests.support.runners import output_bytes, read_records
from tests.support.wait import wait_for
from tests.support.workers import (
    enqueue,
    events,
    pid_alive,
    wait_rq_status,
    wait_state,
)
from worker.uploads.spool import MANIFEST_NAME

pytestmark = pytest.mark.timeout(240)

# Names other test modules imported from here before tests/support/ held them (kept so branches in flight
# still import); new code imports them from tests.support.fleet.
_start_worker, _metric = start_worker, metric
__all__ = ["Fleet", "_metric", "_start_worker", "running_worker"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    from devstack.tcp_proxy import TcpProxy

    tmp = tmp_path_factory.mktemp("worker")
    proxy = TcpProxy(s3_server.s3_port).start()
    f = start_worker(tmp, redis_server, s3_server, proxy, "fault", "cpu:2", upload_attempts=3,
                      retry_fleet_failure=1, retry_upload_failed=1)  # fmt: skip
    try:
        yield f
    finally:
        proxy.unblock()
        rc = f.proc.stop()
        proxy.block()
        f.conn.close()
        assert rc == 0, f.proc.log_tail()


def _types(evts: list[dict[str, Any]]) -> list[str]:
    return [e["state"] if e["type"] == "state" else e["type"] for e in evts]


def _check_object(s3_server: Any, result: dict[str, Any], expected: bytes) -> None:
    sha = hashlib.sha256(expected).hexdigest()
    assert result["sha256"] == sha and result["size"] == len(expected)
    head = s3_server.client().head_object(Bucket=result["bucket"], Key=result["key"])
    assert head["Metadata"]["sha256"] == sha
    assert head["ContentType"] == "video/mp4"
    assert s3_server.http_get(result["url"]) == expected  # the presigned URL works for an outside client


# ==== the smoke runner: the real pipeline, SP over two CPU ranks ========================================


def test_smoke_job_streams_ordered_events_and_uploads_matching_object(tmp_path, redis_server, s3_server):
    from devstack.tcp_proxy import TcpProxy

    proxy = TcpProxy(s3_server.s3_port).start()
    f = start_worker(tmp_path, redis_server, s3_server, proxy, "smoke", "cpu:2",
                      runner_setup=json.dumps({"default_steps": 2}))  # fmt: skip
    try:
        job = f.submit("a red fox in the snow", seed=7, steps=2)
        assert wait_state(job, {"uploaded", "failed"}, 180, f.proc) == "uploaded", job.get_meta()
        evts = events(f.conn, job.id)
        kinds = _types(evts)
        assert kinds[:2] == ["started", "rendering"]
        assert kinds[-1] == "uploaded"
        # the fleet hands the frames off (its output event), then the worker encodes (`mux`) and commits
        order = ["started", "rendering", "encode", "denoise", "decode", "output", "mux", "rendered", "uploading",
                 "uploaded"]  # fmt: skip
        seen = [e.get("stage", e.get("state", e["type"])) for e in evts]
        positions = [seen.index(x) for x in order]
        assert positions == sorted(positions), seen
        steps = [e["step"] for e in evts if e["type"] == "progress"]
        assert steps == [1, 2]
        assert [e["ts"] for e in evts] == sorted(e["ts"] for e in evts)
        # the output event names the file, not the worker's local spool path
        (output,) = [e for e in evts if e["type"] == "output"]
        assert "path" not in output and output["file"] == "video.mp4" and str(f.spool) not in json.dumps(evts)
        # plain rq APIs see the summary and the result
        fetched = Job.fetch(job.id, connection=f.conn, serializer=JSONSerializer)
        meta = fetched.get_meta()
        assert meta["state"] == "uploaded" and meta["percent"] == 100.0 and meta["fleet"] == "cpu:2"
        assert fetched.get_status() == JobStatus.FINISHED
        result = fetched.latest_result().return_value
        assert result == meta["result"]
        data = s3_server.client().get_object(Bucket=result["bucket"], Key=result["key"])["Body"].read()
        assert data[4:8] == b"ftyp"  # an mp4 container
        _check_object(s3_server, result, data)
        assert result["fleet"]["world_size"] == 2
        assert not (f.spool / job.id).exists()  # released after the confirmed upload
    finally:
        assert f.proc.stop() == 0, f.proc.log_tail()
        proxy.block()


# ==== the fault runner ==================================================================================


def test_job_result_object_and_rq_summary(fleet, s3_server):
    fleet.idle()
    job = fleet.submit("t bytes=100000", seed=3, steps=3)
    assert wait_state(job, {"uploaded", "failed"}, 60, fleet.proc) == "uploaded"
    result = job.latest_result().return_value
    _check_object(s3_server, result, output_bytes(3, 100000))
    assert re.fullmatch(rf"videos/[0-9a-f]{{16}}/{job.id}/video\.mp4", result["key"]), result["key"]  # one per render
    # upload_wait_s: time in the background uploader's queue (the pipeline is on by default)
    assert set(result["timings"]) == {"queue_wait_s", "render_s", "upload_s", "upload_wait_s", "total_s"}
    kinds = _types(events(fleet.conn, job.id))
    assert kinds[:3] == ["started", "rendering", "stage"] and kinds[-1] == "uploaded"
    assert kinds.count("progress") == 3
    ttl = fleet.conn.ttl(f"ltx:job:{job.id}:events")
    assert 0 < ttl <= 3600  # expires with the job's result_ttl


def test_multipart_upload_above_threshold(fleet, s3_server):
    fleet.idle()
    size = 20 * 1024 * 1024  # above the default 16 MiB multipart threshold
    job = fleet.submit(f"t bytes={size}", seed=5, steps=1)
    assert wait_state(job, {"uploaded", "failed"}, 90, fleet.proc) == "uploaded"
    result = job.latest_result().return_value
    head = s3_server.client().head_object(Bucket=result["bucket"], Key=result["key"])
    assert "-" in head["ETag"], head["ETag"]  # a multipart ETag
    assert head["Metadata"]["sha256"] == hashlib.sha256(output_bytes(5, size)).hexdigest()
    assert any(e["type"] == "upload" and e.get("done") for e in events(fleet.conn, job.id))


def test_invalid_request_names_field_and_leaves_fleet_untouched(fleet):
    before = fleet.idle()["fleet"]["pids"]
    job = fleet.submit("t", width=100)
    wait_rq_status(job, {JobStatus.FAILED}, 30, fleet.proc)
    meta = job.get_meta(refresh=True)
    assert meta["state"] == "failed"
    assert meta["error"]["reason"] == "invalid_request" and meta["error"]["field"] == "width"
    assert "multiple of 32" in meta["error"]["message"]
    assert job.retries_left in (0, None)
    assert "invalid_request" in job.latest_result().exc_string
    after = fleet.idle()["fleet"]
    assert after["pids"] == before and after["alive"]
    # unknown fields too
    job2 = enqueue(fleet.conn, fleet.queue, {"prompt": "t", "widht": 64})
    wait_rq_status(job2, {JobStatus.FAILED}, 30, fleet.proc)
    assert job2.get_meta(refresh=True)["error"]["field"] == "widht"


def test_runner_error_fails_without_retry_and_fleet_survives(fleet):
    before = fleet.idle()["fleet"]["pids"]
    job = fleet.submit("t error=runner")
    wait_rq_status(job, {JobStatus.FAILED}, 30, fleet.proc)
    err = job.get_meta(refresh=True)["error"]
    assert err["reason"] == "runner_error" and "injected runner error" in err["message"]
    assert fleet.idle()["fleet"]["pids"] == before


def test_cancel_running_job_keeps_fleet_and_next_job_succeeds(fleet):
    before = fleet.idle()["fleet"]["pids"]
    job = fleet.submit("t step_s=0.2", steps=100)
    queued = fleet.submit("t")  # waits behind the first; cancelled while queued
    wait_for(lambda: (job.get_meta(refresh=True).get("step") or 0) >= 2, 30, "progress", on_fail=fleet.proc.log_tail)
    assert cancel_job(fleet.conn, queued.id) == "cancelled"
    assert cancel_job(fleet.conn, job.id) == "stop_requested"
    # a cancel is not a failure: RQ records it like a cancelled queued job, in the canceled registry
    assert wait_rq_status(job, {JobStatus.CANCELED}, 30, fleet.proc)
    q = Queue(fleet.queue, connection=fleet.conn, serializer=JSONSerializer)
    assert job.id in q.canceled_job_registry.get_job_ids(cleanup=False)
    assert job.id not in q.failed_job_registry.get_job_ids(cleanup=False)
    assert job.latest_result() is None  # no failure result either
    assert job.get_meta(refresh=True)["state"] == "cancelled"
    assert _types(events(fleet.conn, job.id))[-1] == "cancelled"
    assert queued.get_status(refresh=True) == JobStatus.CANCELED
    assert _types(events(fleet.conn, queued.id)) == ["cancelled"]
    info = fleet.idle()
    assert info["fleet"]["pids"] == before and info["fleet"]["alive"]
    nxt = fleet.submit("t")
    assert wait_state(nxt, {"uploaded", "failed"}, 30, fleet.proc) == "uploaded"
    assert queued.get_meta(refresh=True)["state"] == "cancelled"  # never ran


def test_rank_killed_mid_job_fails_with_fleet_failure_rebuilds_and_next_job_succeeds(fleet, tmp_path):
    info = fleet.idle()
    old_pids, rebuilds = info["fleet"]["pids"], info["fleet"]["rebuilds"]
    record = tmp_path / "exec.jsonl"
    # retry_fleet_failure=1: the first failure is retried, the retry dies the same way and the job fails.
    job = fleet.submit(f"t exit_rank=1 exit_step=2 step_s=0.05 record={record}", steps=4)
    wait_rq_status(job, {JobStatus.FAILED}, 90, fleet.proc)
    meta = job.get_meta(refresh=True)
    err = meta["error"]
    assert err["reason"] == "fleet_failure" and err["rank"] == 1 and err["exitcode"] == 9, err
    assert err["fleet_reason"] in ("rank_exited", "rank_failed")
    kinds = _types(events(fleet.conn, job.id))
    assert kinds.count("retrying") == 1 and kinds[-1] == "failed"
    assert kinds.count("fleet") == 2  # a fleet-failure event per attempt
    # ran twice: once + one retry, no more (counting starts: rank 0 may finish its steps, and record its end,
    # before the death of rank 1 is noticed; the fault runner's steps make no collective)
    starts = [r for r in read_records(record) if r["event"] == "start"]
    assert meta["attempt"] == 2 and len(starts) == 2, read_records(record)
    info = wait_for(lambda: (i := fleet.idle())["fleet"]["rebuilds"] >= rebuilds + 2 and i, 90, "rebuilt fleet")
    assert set(info["fleet"]["pids"]).isdisjoint(old_pids)
    wait_for(lambda: not any(pid_alive(p) for p in old_pids), 20, "old ranks gone")
    nxt = fleet.submit("t")
    assert wait_state(nxt, {"uploaded", "failed"}, 30, fleet.proc) == "uploaded"


def test_idle_fleet_death_is_reported_and_rebuilt_at_once_and_no_job_is_taken_before(fleet):
    """Regression: a rank killed while the fleet was idle went unnoticed until the next job (health, metrics and
    `producer stats` said "ready" for minutes), and the next job was dequeued first, then waited for the
    rebuild. Now the controller's monitor reports it: health and metrics say so at once, the rebuild starts
    at once, and a job submitted meanwhile is only started once the new fleet is warm."""
    import os
    import signal

    info = fleet.idle()
    old_pids, rebuilds, port = info["fleet"]["pids"], info["fleet"]["rebuilds"], info["metrics_port"]
    os.kill(old_pids[1], signal.SIGKILL)
    # reported without any job: the snapshot in Redis and /metrics say the fleet is down (bound generous for
    # a loaded machine; before the fix they said "ready" until a job arrived)
    wait_for(lambda: not fleet.health()["fleet"]["alive"], 10, "health snapshot: fleet down", poll=0.02,
             on_fail=fleet.proc.log_tail)  # fmt: skip
    assert metric(port, 'ltx_worker_fleet_up{group="cpu:2"}') == 'ltx_worker_fleet_up{group="cpu:2"} 0.0'
    assert fleet.health()["fleet"]["last_failure"]["fleet_reason"] == "rank_exited"
    # a job submitted now waits in the queue until the rebuilt fleet is warm
    job = fleet.submit("t")
    # rebuilt without being asked by a job
    rebuilt = wait_for(lambda: (h := fleet.health())["fleet"]["rebuilds"] == rebuilds + 1 and h["fleet"]["alive"]
                       and h, 90, "rebuilt fleet", on_fail=fleet.proc.log_tail)  # fmt: skip
    assert set(rebuilt["fleet"]["pids"]).isdisjoint(old_pids)
    assert wait_state(job, {"uploaded", "failed"}, 60, fleet.proc) == "uploaded", job.get_meta(refresh=True)
    started = next(e for e in events(fleet.conn, job.id) if e.get("state") == "started")
    assert started["ts"] >= rebuilt["fleet"]["ready_at"], (started, rebuilt["fleet"])
    assert job.get_meta(refresh=True)["attempt"] == 1  # it waited; no attempt was spent
    assert metric(port, 'ltx_worker_fleet_failures_total{group="cpu:2",reason="rank_exited"}') is not None
    assert metric(port, 'ltx_worker_fleet_up{group="cpu:2"}') == 'ltx_worker_fleet_up{group="cpu:2"} 1.0'
    wait_for(lambda: not any(pid_alive(p) for p in old_pids), 20, "old ranks gone")


def test_s3_unreachable_during_upload_then_back(fleet, s3_server):
    fleet.idle()
    fleet.proxy.block()
    job = fleet.submit("t bytes=50000", seed=11)

    def retried() -> bool:
        return any(e["type"] == "upload" and "error" in e for e in events(fleet.conn, job.id))

    try:
        wait_for(retried, 30, "a failed upload attempt", on_fail=fleet.proc.log_tail)
        assert (fleet.spool / job.id / MANIFEST_NAME).exists()  # the video waits in the spool meanwhile
    finally:
        fleet.proxy.unblock()
    assert wait_state(job, {"uploaded", "failed"}, 60, fleet.proc) == "uploaded"
    _check_object(s3_server, job.latest_result().return_value, output_bytes(11, 50000))
    # the spool entry is released just after `uploaded` is recorded (a crash in between re-uploads at start)
    wait_for(lambda: not (fleet.spool / job.id).exists(), 30, "the spool entry released", on_fail=fleet.proc.log_tail)


def test_s3_down_for_good_keeps_video_in_spool_and_fails_retryable(fleet, tmp_path):
    fleet.idle()
    record = tmp_path / "exec.jsonl"
    fleet.proxy.block()
    try:
        job = fleet.submit(f"t bytes=30000 record={record}", seed=13)
        wait_rq_status(job, {JobStatus.FAILED}, 90, fleet.proc)
        storage = fleet.health()["storage"]  # (it said `ok` all through the outage)
        assert storage["state"] == "degraded" and "uploads failing" in storage["error"], storage
        assert str(metric(fleet.health()["metrics_port"], "ltx_worker_storage_up{")).endswith(" 0.0")
    finally:
        fleet.proxy.unblock()
    meta = job.get_meta(refresh=True)
    assert meta["error"]["reason"] == "upload_failed" and meta["error"]["retryable"] is True
    kinds = _types(events(fleet.conn, job.id))
    assert kinds.count("retrying") == 1  # retry_upload_failed=1
    resumed = [e for e in events(fleet.conn, job.id) if e.get("resumed_from_spool")]
    assert len(resumed) == 1  # the retry uploaded from the spool instead of rendering again
    assert len([r for r in read_records(record) if r["event"] == "start"]) == 1
    manifest = json.loads((fleet.spool / job.id / MANIFEST_NAME).read_text())
    video = fleet.spool / job.id / manifest["file_name"]
    assert hashlib.sha256(video.read_bytes()).hexdigest() == manifest["sha256"]
    assert manifest["sha256"] == hashlib.sha256(output_bytes(13, 30000)).hexdigest()
    assert manifest["attempts"] == 6  # 3 attempts per execution, both recorded in the manifest
    ok = fleet.submit("t", seed=14)  # storage back: the next confirmed upload clears the degraded state
    assert wait_state(ok, {"uploaded", "failed"}, 60, fleet.proc) == "uploaded"
    wait_for(lambda: fleet.health()["storage"]["state"] == "ok", 10, "storage ok again")


def test_heartbeats_keep_long_job_from_being_abandoned(fleet, tmp_path):
    """The job runs longer than job_heartbeat_ttl (6 s); a registry cleanup (what another worker's
    maintenance does) in the middle must not see it as abandoned, so it is never run twice."""
    fleet.idle()
    record = tmp_path / "exec.jsonl"
    job = fleet.submit(f"t step_s=0.5 record={record}", steps=20)
    wait_state(job, "rendering", 30, fleet.proc)
    time.sleep(8)
    registry = StartedJobRegistry(fleet.queue, connection=fleet.conn, serializer=JSONSerializer)
    registry.cleanup()
    assert job.id in registry.get_job_ids(cleanup=False)
    assert wait_state(job, {"uploaded", "failed"}, 60, fleet.proc) == "uploaded"
    assert [r["event"] for r in read_records(record)] == ["start", "end"]
    # one execution, one result: the pipeline's full result replaced RQ's hand-off value at `uploaded`
    assert [r.return_value["state"] for r in job.results()] == ["uploaded"]
    assert job.get_meta(refresh=True)["attempt"] == 1


def test_metrics_and_health_endpoints(fleet):
    fleet.idle()
    job = fleet.submit("t")
    assert wait_state(job, {"uploaded", "failed"}, 30, fleet.proc) == "uploaded"
    port = fleet.idle()["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'ltx_worker_jobs_total{group="cpu:2",outcome="uploaded",reason=""}' in text
    assert 'ltx_worker_fleet_up{group="cpu:2"} 1.0' in text
    assert "ltx_worker_render_seconds_bucket" in text and "ltx_worker_queue_wait_seconds_count" in text
    assert 'ltx_worker_fleet_rebuilds_total{group="cpu:2",result="ok"}' in text
    assert 'ltx_worker_spool_entries{group="cpu:2"}' in text
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
        body = json.loads(resp.read())
    assert resp.status == 200 and body["ready"] and body["fleet"]["alive"]
    probe = subprocess.run([sys.executable, "-m", "worker", "health", "--port", str(port)], capture_output=True,
                           text=True, timeout=60, check=False)  # fmt: skip
    assert probe.returncode == 0 and json.loads(probe.stdout)["ready"]


def test_cancel_right_after_start_is_honoured(fleet):
    """A cancel sent the moment RQ reports the job started (the fleet may not have the job yet) stops it."""
    fleet.idle()
    job = fleet.submit("t step_s=0.3", steps=30)
    probe = Job(job.id, connection=fleet.conn, serializer=JSONSerializer)
    wait_for(lambda: probe.get_status(refresh=True) == JobStatus.STARTED, 20, "started", poll=0.005)
    assert cancel_job(fleet.conn, job.id) == "stop_requested"
    # a cancel is not a failure: RQ records it like a cancelled queued job, in the canceled registry
    assert wait_rq_status(job, {JobStatus.CANCELED}, 30, fleet.proc)
    q = Queue(fleet.queue, connection=fleet.conn, serializer=JSONSerializer)
    assert job.id in q.canceled_job_registry.get_job_ids(cleanup=False)
    assert job.id not in q.failed_job_registry.get_job_ids(cleanup=False)
    assert job.latest_result() is None  # no failure result either
    assert job.get_meta(refresh=True)["state"] == "cancelled"
    assert fleet.idle()["fleet"]["alive"]
