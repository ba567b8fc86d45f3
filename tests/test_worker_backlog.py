"""The background upload pipeline (`worker/stages/upload.py`) end to end: real Redis, real S3 (SeaweedFS)
behind a `TcpProxy` that a test blocks to make storage unreachable, real `ltx-worker one` processes with CPU
fleets running the fault-injection runner.

What is shown: the fleet takes the next job while the previous video is still uploading; a worker killed
between render and upload uploads the file after restart and the job ends `uploaded`; a bound on pending
uploads (count or bytes) stops the worker from taking jobs (back-pressure, visible in health and metrics)
while renders continue up to it with S3 down and nothing is lost; a warm stop drains pending uploads (or
leaves them in the spool when its timeout passes); the synchronous mode still uploads inside the job.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from rq.job import JobStatus

from ltx_contract.handoff import HandOff
from tests.support.runners import output_bytes, read_records
from tests.support.wait import wait_for
from tests.support.workers import events, launch_worker, pid_alive, wait_ready, wait_state, worker_health
from worker.uploads.spool import MANIFEST_NAME

pytestmark = pytest.mark.timeout(240)

_PENDING = {"rendered", "uploading"}


class Worker:
    """One `ltx-worker one` under test, its queue, Redis connection, S3 proxy and spool."""

    def __init__(self, tmp: Path, redis_server: Any, s3_server: Any, proxy: Any, *, queue: str | None = None,
                 spool: Path | None = None, group: str = "cpu:1", **extra: Any) -> None:  # fmt: skip
        self.spool = spool or tmp / "spool"
        self.proxy = proxy
        settings = {"upload_attempts": 200, "upload_backoff_s": 0.1, "upload_backoff_max_s": 0.3, **extra}
        self.launched = launch_worker(tmp, redis_server, s3_server, ["one", "--group", group], prefix="b",
                                      queue=queue, spool=self.spool, s3_url=proxy.url, **settings)  # fmt: skip
        self.proc, self.conn, self.queue, self.name = (self.launched.proc, self.launched.conn,
                                                       self.launched.queue, self.launched.name)  # fmt: skip
        (self.info,) = wait_ready(self.conn, self.name, 1, 120, self.proc)

    def submit(self, prompt: str, **request: Any) -> Any:
        return self.launched.submit(prompt, **request)

    def health(self) -> dict[str, Any]:
        infos = [h for h in worker_health(self.conn, self.name) if pid_alive(h["pid"])]
        assert len(infos) == 1, infos
        return infos[0]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health()['metrics_port']}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> int | None:
        return self.proc.stop(90)


def _state(job: Any) -> str | None:
    return job.get_meta(refresh=True).get("state")


def _check_uploaded(job: Any, s3_server: Any, seed: int, size: int) -> dict[str, Any]:
    """The job's result, meta and RQ result agree, and the object in the bucket has the expected bytes."""
    meta = job.get_meta(refresh=True)
    assert meta["state"] == "uploaded", meta
    result = meta["result"]
    expected = output_bytes(seed, size)
    sha = hashlib.sha256(expected).hexdigest()
    assert result["sha256"] == sha and result["size"] == size
    head = s3_server.client().head_object(Bucket=result["bucket"], Key=result["key"])
    assert head["Metadata"]["sha256"] == sha and head["ContentLength"] == size
    body = s3_server.client().get_object(Bucket=result["bucket"], Key=result["key"])["Body"].read()
    assert hashlib.sha256(body).hexdigest() == sha
    assert job.latest_result().return_value == result  # plain RQ sees the full result once uploaded
    assert [r.return_value.get("state") for r in job.results() if r.type.name == "SUCCESSFUL"][:1] == ["uploaded"]
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    return result


def _first_ts(evts: list[dict[str, Any]], state: str) -> float:
    return next(e["ts"] for e in evts if e["type"] == "state" and e["state"] == state)


@pytest.fixture
def proxy(s3_server: Any) -> Any:
    from devstack.tcp_proxy import TcpProxy

    p = TcpProxy(s3_server.s3_port).start()
    try:
        yield p
    finally:
        p.block()


# ==== the pipeline =======================================================================================


def test_next_job_starts_while_previous_video_uploads(tmp_path, redis_server, s3_server, proxy):
    w = Worker(tmp_path, redis_server, s3_server, proxy, max_pending_uploads=4)
    try:
        proxy.block()  # storage unreachable: the first upload cannot finish until we say so
        first = w.submit("t bytes=300000", seed=21)
        second = w.submit("t bytes=200000", seed=22)
        # the fleet renders the second job while the first video waits for storage
        wait_for(lambda: _state(second) in _PENDING, 60, "second job rendered", on_fail=w.proc.log_tail)
        assert _state(first) in _PENDING
        assert first.get_status(refresh=True) == JobStatus.FINISHED  # RQ: the job function returned
        handoff = first.latest_result().return_value  # the hand-off, not a result: typed, JSON as written
        assert HandOff.from_json(handoff).to_json() == handoff and HandOff.read(handoff).state == "rendered"
        assert (w.spool / first.id / MANIFEST_NAME).exists()
        # The health key is refreshed by heartbeats: the one after the second hand-off may be a beat away.
        health = wait_for(lambda: (u := w.health()["uploads"])["pending"] == 2 and u, 10, "health: 2 pending",
                          on_fail=w.health)  # fmt: skip
        assert health["background"] is True and not health["backpressure"]
        proxy.unblock()
        assert wait_state(first, {"uploaded", "failed"}, 60, w.proc) == "uploaded"
        assert wait_state(second, {"uploaded", "failed"}, 60, w.proc) == "uploaded"
        r1 = _check_uploaded(first, s3_server, 21, 300000)
        _check_uploaded(second, s3_server, 22, 200000)
        e1, e2 = events(w.conn, first.id), events(w.conn, second.id)
        # the first job's upload was confirmed after the fleet had started (and finished) the next render
        assert _first_ts(e1, "uploaded") > _first_ts(e2, "rendering")
        assert _first_ts(e1, "uploaded") > _first_ts(e2, "rendered")
        kinds = [e["state"] for e in e1 if e["type"] == "state"]
        assert kinds == ["started", "rendering", "rendered", "uploading", "uploaded"], kinds
        assert set(r1["timings"]) >= {"queue_wait_s", "render_s", "upload_s", "upload_wait_s", "total_s"}
        assert not (w.spool / first.id).exists() and not (w.spool / second.id).exists()
        assert w.conn.ttl(f"ltx:job:{first.id}:events") <= 3600  # expires with the result TTL
    finally:
        proxy.unblock()
        assert w.stop() == 0, w.proc.log_tail()


def test_pending_upload_bound_applies_backpressure_and_nothing_is_lost(tmp_path, redis_server, s3_server, proxy):
    """S3 down: renders continue up to max_pending_uploads, then the worker takes no job (back-pressure in
    health and metrics); S3 back: every job ends uploaded with the right bytes."""
    record = tmp_path / "exec.jsonl"
    w = Worker(tmp_path, redis_server, s3_server, proxy, max_pending_uploads=2)
    try:
        proxy.block()
        jobs = [w.submit(f"t bytes=100000 record={record}", seed=30 + i) for i in range(4)]
        wait_for(lambda: w.health()["uploads"]["backpressure"], 60, "back-pressure", on_fail=w.proc.log_tail)
        time.sleep(1.5)  # long enough for a third render, were the bound not applied
        starts = [r for r in read_records(record) if r["event"] == "start"]
        assert len(starts) == 2, starts
        assert [_state(j) in _PENDING for j in jobs[:2]] == [True, True]
        assert [j.get_status(refresh=True) for j in jobs[2:]] == [JobStatus.QUEUED, JobStatus.QUEUED]
        text = w.metrics()
        assert 'ltx_worker_backpressure{group="cpu:1"} 1.0' in text
        assert 'ltx_worker_upload_pending{group="cpu:1"} 2.0' in text
        assert sum(1 for d in w.spool.iterdir() if (d / MANIFEST_NAME).exists()) == 2
        proxy.unblock()
        for i, job in enumerate(jobs):
            assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "uploaded"
            _check_uploaded(job, s3_server, 30 + i, 100000)
        assert len([r for r in read_records(record) if r["event"] == "start"]) == 4  # each rendered once
        text = w.metrics()
        assert 'ltx_worker_backpressure{group="cpu:1"} 0.0' in text
        seconds = float(text.split('ltx_worker_backpressure_seconds_total{group="cpu:1"} ')[1].split()[0])
        assert seconds >= 1.0
        assert not any(w.spool.iterdir())
    finally:
        proxy.unblock()
        assert w.stop() == 0, w.proc.log_tail()


def test_pending_bytes_bound_applies_backpressure(tmp_path, redis_server, s3_server, proxy):
    record = tmp_path / "exec.jsonl"
    mib = 1024 * 1024
    w = Worker(tmp_path, redis_server, s3_server, proxy, max_pending_uploads=100, max_pending_bytes=mib)
    try:
        proxy.block()
        jobs = [w.submit(f"t bytes={600 * 1024} record={record}", seed=40 + i) for i in range(3)]
        wait_for(lambda: w.health()["uploads"]["backpressure"], 60, "back-pressure", on_fail=w.proc.log_tail)
        time.sleep(1.0)
        assert len([r for r in read_records(record) if r["event"] == "start"]) == 2  # 1.2 MB >= 1 MiB bound
        assert jobs[2].get_status(refresh=True) == JobStatus.QUEUED
        proxy.unblock()
        for i, job in enumerate(jobs):
            assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "uploaded"
            _check_uploaded(job, s3_server, 40 + i, 600 * 1024)
    finally:
        proxy.unblock()
        assert w.stop() == 0, w.proc.log_tail()


# ==== crashes and stops ==================================================================================


def test_worker_killed_between_render_and_upload_uploads_after_restart(tmp_path, redis_server, s3_server, proxy):
    record = tmp_path / "exec.jsonl"
    w = Worker(tmp_path, redis_server, s3_server, proxy)
    proxy.block()
    job = w.submit(f"t bytes=250000 record={record}", seed=51)
    try:
        wait_for(lambda: _state(job) in _PENDING and (w.spool / job.id / MANIFEST_NAME).exists(), 60,
                 "rendered, waiting for storage", on_fail=w.proc.log_tail)  # fmt: skip
        w.proc.signal(signal.SIGKILL)
        w.proc.wait(10)
        wait_for(lambda: not any(pid_alive(p) for p in w.info["fleet"]["pids"]), 30, "ranks gone")
        assert _state(job) in _PENDING  # nobody could record anything else
        assert (w.spool / job.id / MANIFEST_NAME).exists()
    finally:
        proxy.unblock()
    w2 = Worker(tmp_path, redis_server, s3_server, proxy, queue=w.queue, spool=w.spool)
    try:
        assert wait_state(job, {"uploaded", "failed"}, 60, w2.proc) == "uploaded"
        result = _check_uploaded(job, s3_server, 51, 250000)
        assert result["recovered"] is True
        assert [r["event"] for r in read_records(record)] == ["start", "end"]  # rendered once, never again
        uploading = [e for e in events(w2.conn, job.id) if e.get("state") == "uploading"]
        assert uploading[-1].get("recovered") is True
        assert not (w.spool / job.id).exists()
    finally:
        assert w2.stop() == 0, w2.proc.log_tail()


def test_warm_stop_drains_pending_uploads(tmp_path, redis_server, s3_server, proxy):
    w = Worker(tmp_path, redis_server, s3_server, proxy)
    try:
        proxy.block()
        job = w.submit("t bytes=150000", seed=61)
        wait_for(lambda: _state(job) in _PENDING, 60, "rendered", on_fail=w.proc.log_tail)
        w.proc.signal(signal.SIGTERM)
        time.sleep(1.5)
        assert w.proc.proc.poll() is None  # still draining: the upload is pending
        proxy.unblock()
        assert w.proc.wait(60) == 0, w.proc.log_tail()
        _check_uploaded(job, s3_server, 61, 150000)
        assert not (w.spool / job.id).exists()
    finally:
        proxy.unblock()
        w.stop()


def test_warm_stop_drain_timeout_leaves_video_for_next_start(tmp_path, redis_server, s3_server, proxy):
    w = Worker(tmp_path, redis_server, s3_server, proxy, upload_drain_timeout_s=1)
    proxy.block()
    job = w.submit("t bytes=120000", seed=71)
    try:
        wait_for(lambda: _state(job) in _PENDING, 60, "rendered", on_fail=w.proc.log_tail)
        t0 = time.monotonic()
        w.proc.signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0, w.proc.log_tail()
        assert time.monotonic() - t0 < 30
        assert _state(job) in _PENDING  # not failed: interrupted by the stop, not by storage
        manifest = json.loads((w.spool / job.id / MANIFEST_NAME).read_text())
        assert manifest["sha256"] == hashlib.sha256(output_bytes(71, 120000)).hexdigest()
    finally:
        proxy.unblock()
    w2 = Worker(tmp_path, redis_server, s3_server, proxy, queue=w.queue, spool=w.spool)
    try:
        assert wait_state(job, {"uploaded", "failed"}, 60, w2.proc) == "uploaded"
        _check_uploaded(job, s3_server, 71, 120000)
    finally:
        assert w2.stop() == 0, w2.proc.log_tail()


# ==== the synchronous mode ===============================================================================


def test_pipeline_off_uploads_inside_the_job(tmp_path, redis_server, s3_server, proxy):
    w = Worker(tmp_path, redis_server, s3_server, proxy, upload_pipeline="false")
    try:
        first = w.submit("t bytes=80000", seed=81)
        second = w.submit("t bytes=80000", seed=82)
        for job in (first, second):
            assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded"
        r1 = _check_uploaded(first, s3_server, 81, 80000)
        assert len(first.results()) == 1 and "upload_wait_s" not in r1["timings"]
        # synchronous: the first upload was confirmed before the fleet started the second job
        assert _first_ts(events(w.conn, first.id), "uploaded") < _first_ts(events(w.conn, second.id), "started")
        assert w.health()["uploads"]["background"] is False
    finally:
        assert w.stop() == 0, w.proc.log_tail()


def test_health_snapshot_follows_the_upload_without_waiting_for_a_heartbeat(tmp_path, redis_server, s3_server, proxy):
    """Regression: the snapshot in Redis was written at render end and then only with RQ's heartbeat, so
    `producer stats` showed "jobs 0" after the first job and an upload still `pending` once it had finished.
    With a long worker TTL (RQ beats rarely) it must still follow the upload at once."""
    w = Worker(tmp_path, redis_server, s3_server, proxy, worker_ttl=300)
    try:
        job = w.submit("t bytes=50000", seed=41)
        assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded"

        def caught_up() -> bool:
            h = w.health()
            return h["jobs_done"] == 1 and h["uploads"]["pending"] == 0 and h["current_job"] is None

        wait_for(caught_up, 20, "health snapshot after the upload", on_fail=lambda: str(w.health()))
    finally:
        assert w.stop() == 0, w.proc.log_tail()
