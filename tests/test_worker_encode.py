"""The worker encodes the mp4 beside the fleet: real Redis, real S3 (SeaweedFS), real `ltx-worker one`
processes with a CPU fleet running the fault runner's `yuv=N` hand-off (noise frames as a `media` event).

A slow encoder (x264 `placebo`, one thread: seconds for a few noise frames) makes the overlap visible
without timing assumptions: the second job's first runner event must come before the first job's video is
even committed, which only holds if the fleet no longer waits for the encode. The back-pressure bound and
the crash rule (a worker killed mid-encode: the job renders again, never lost) use the same runner.
"""

from __future__ import annotations

import hashlib
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from ltx_mgpu.media.mp4_read import probe_mp4
from tests.support.fleet import metric, running_worker, start_worker
from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, events, wait_ready, wait_state, worker_env

pytestmark = pytest.mark.timeout(300)
SLOW = {"encode_preset": "placebo", "encode_threads": 1}
SIZE = {"width": 192, "height": 192}


def _ts(evts: list[dict[str, Any]], kind: str, name: str | None = None) -> float:
    """The first event of `kind` ("stage" or a state name) and, for stages, of that stage name."""
    for e in evts:
        if kind == "stage" and e["type"] == "stage" and (name is None or e.get("stage") == name):
            return float(e["ts"])
        if e["type"] == "state" and e.get("state") == kind:
            return float(e["ts"])
    raise AssertionError(f"no {kind} {name or ''} event in {[e.get('state', e['type']) for e in evts]}")


def _stored_video(s3_server: Any, result: dict[str, Any], tmp: Path) -> Path:
    data = s3_server.client().get_object(Bucket=result["bucket"], Key=result["key"])["Body"].read()
    assert hashlib.sha256(data).hexdigest() == result["sha256"] and len(data) == result["size"]
    path = tmp / f"{uuid.uuid4().hex[:6]}.mp4"
    path.write_bytes(data)
    return path


def test_the_fleet_takes_the_next_job_while_the_previous_video_encodes(tmp_path, redis_server, s3_server):
    with running_worker(tmp_path, redis_server, s3_server, **SLOW) as f:
        a = f.submit("t yuv=9", seed=1, **SIZE)
        b = f.submit("t yuv=9", seed=2, **SIZE)
        for job in (a, b):
            assert wait_state(job, {"uploaded", "failed"}, 240, f.proc) == "uploaded", job.get_meta()
        ea, eb = events(f.conn, a.id), events(f.conn, b.id)
        # b's render began before a's mp4 existed: the fleet did not wait for a's encode
        assert _ts(eb, "stage", "denoise") < _ts(ea, "rendered") < _ts(ea, "uploaded")
        seen = [e.get("state", e.get("stage", e["type"])) for e in ea]
        order = ["rendering", "denoise", "output", "mux", "rendered", "uploading", "uploaded"]
        positions = [seen.index(x) for x in order]
        assert positions == sorted(positions), seen
        (output,) = [e for e in ea if e["type"] == "output"]
        assert output["media"] == "stream" and "video" not in output  # the frames never reach Redis
        rendered = next(e for e in ea if e.get("state") == "rendered")
        assert rendered["encode_s"] > 0 and rendered["bytes"] > 0
        for job in (a, b):
            result = job.latest_result().return_value
            streams = probe_mp4(_stored_video(s3_server, result, tmp_path))
            assert (streams.video_codec, streams.frames, streams.width, streams.height) == ("h264", 9, 192, 192)
        assert not any((f.spool / job.id).exists() for job in (a, b))  # released after the confirmed uploads
        port = f.health()["metrics_port"]
        busy = metric(port, "ltx_worker_fleet_busy_seconds_total{")  # the runners' device clock: 0.25 s a job
        assert busy is not None and float(busy.split()[-1]) == 0.5, busy
        encodes = metric(port, "ltx_worker_encode_seconds_count{")
        assert encodes is not None and float(encodes.split()[-1]) == 2.0, encodes


def test_at_the_encode_bound_the_worker_takes_no_job(tmp_path, redis_server, s3_server):
    with running_worker(tmp_path, redis_server, s3_server, max_pending_encodes=1, **SLOW) as f:
        a = f.submit("t yuv=9", seed=1, **SIZE)
        b = f.submit("t yuv=9", seed=2, **SIZE)
        for job in (a, b):
            assert wait_state(job, {"uploaded", "failed"}, 240, f.proc) == "uploaded", job.get_meta()
        # one video in the encoder is the bound: b was not even started until a's encode had ended
        assert _ts(events(f.conn, b.id), "started") > _ts(events(f.conn, a.id), "rendered")


def test_a_worker_killed_mid_encode_loses_no_job(tmp_path, redis_server, s3_server):
    f = start_worker(tmp_path, redis_server, s3_server, None, "fault", "cpu:1", **SLOW)
    again = None
    try:
        a = f.submit("t yuv=9", seed=3, width=256, height=256)
        wait_for(lambda: any(e.get("stage") == "mux" for e in events(f.conn, a.id)), 120, "the encode to start",
                 on_fail=f.proc.log_tail)  # fmt: skip
        assert (f.spool / a.id / "encoding.json").exists()
        f.proc.signal(signal.SIGKILL)
        f.proc.wait(30)
        assert a.get_meta(refresh=True)["state"] == "rendering"  # no video survived; the job is not done
        name = f"t{uuid.uuid4().hex[:6]}"
        env = worker_env(redis_server.url, s3_server, queue=f.queue, name=name, spool=f.spool, runner="fault")
        again = WorkerProcess(["one", "--group", "cpu:1"], env, Path(tempfile.mkdtemp(dir=tmp_path)) / "w.log")
        again.start()
        wait_ready(f.conn, name, 1, 120, again)
        assert wait_state(a, {"uploaded", "failed"}, 240, again) == "uploaded", a.get_meta()
        meta = a.get_meta(refresh=True)
        assert meta["attempt"] == 2 and meta["retries"] == {"worker_lost": 1}, meta
        assert [e.get("state") for e in events(f.conn, a.id)].count("retrying") == 1
        streams = probe_mp4(_stored_video(s3_server, a.latest_result().return_value, tmp_path))
        assert (streams.frames, streams.width) == (9, 256)
    finally:
        if again is not None:
            assert again.stop() == 0, again.log_tail()
        f.conn.close()


def test_with_the_upload_pipeline_off_the_job_encodes_and_uploads_before_it_returns(tmp_path, redis_server,
                                                                                     s3_server):  # fmt: skip
    # (and the one-shot hand-off: frames after the decode, `media="frames"`)
    with running_worker(tmp_path, redis_server, s3_server, upload_pipeline="false", encode_stream="false") as f:
        a = f.submit("t yuv=9", seed=4, **SIZE)
        assert wait_state(a, {"uploaded", "failed"}, 120, f.proc) == "uploaded", a.get_meta()
        result = a.latest_result().return_value
        assert result["state"] == "uploaded"  # the job's own return value: no hand-off placeholder
        assert probe_mp4(_stored_video(s3_server, result, tmp_path)).frames == 9
        assert not (f.spool / a.id).exists()


def test_recovery_leaves_a_job_killed_before_rq_recorded_its_return_to_the_abandoned_job_cleanup(
    redis_server, tmp_path
):  # fmt: skip
    """A worker SIGKILLed between the job function's return and RQ's bookkeeping leaves the job `started` in
    RQ's registry: the abandoned-job cleanup re-queues it. Recovery re-queuing it too would run it twice, so
    it only drops the marker."""
    import json
    import threading
    from types import SimpleNamespace

    from rq import Queue
    from rq.job import JobStatus
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC
    from worker.rq.record import submission_of
    from worker.stages.encode import MARKER_NAME, EncodeStage
    from worker.stages.upload import UploadPipeline
    from worker.uploads.spool import Spool

    conn = redis_server.client()
    queue = Queue(f"q-{uuid.uuid4().hex[:6]}", connection=conn, serializer=JSONSerializer)
    job = queue.enqueue(RENDER_FUNC, {"prompt": "t"})
    queue.remove(job)
    job.meta["state"] = "rendering"
    job.save_meta()
    job.set_status(JobStatus.STARTED)
    spool = Spool(tmp_path / "spool")
    spool.prepare(job.id, "video.mp4")
    (spool.job_dir(job.id) / MARKER_NAME).write_text(json.dumps({"job_id": job.id, "submission": submission_of(job)}))
    never = SimpleNamespace(relay=lambda j: pytest.fail("recorded"), failed=lambda *a, **k: pytest.fail("recorded"))
    pipeline = UploadPipeline(uploader=None, spool=spool, metrics=None, group="g", worker_name="w", threads=1,
                              max_pending=4, max_pending_bytes=1 << 20, outcomes=never, make_result=None,
                              stop=threading.Event())  # fmt: skip
    settings = SimpleNamespace(max_pending_encodes=2)
    stage = EncodeStage(spool=spool, pipeline=pipeline, settings=settings, metrics=None, group="g")
    assert stage.recover(conn) == 0
    assert not spool.job_dir(job.id).exists()  # the marker is gone; the job is the cleanup's
    assert job.get_status(refresh=True) == JobStatus.STARTED and queue.count == 0
