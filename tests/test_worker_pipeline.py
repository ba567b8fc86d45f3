"""The upload pipeline's parts without a worker: progress events of one upload, and spool recovery against a
real Redis that restarts under it."""

from __future__ import annotations

import threading


def test_upload_progress_reports_completion_once():
    """The transfer callback's last increment and `finish()` both said "all bytes sent": watchers printed
    the final upload line twice."""
    from worker.uploads.uploader import _Progress

    events: list[dict] = []
    progress = _Progress(100, events.append, interval_s=0.0)
    for _ in range(4):
        progress(25)
    progress.finish()
    assert [e["bytes"] for e in events] == [25, 50, 75, 100]
    assert [e.get("done", False) for e in events] == [False, False, False, True]


def test_spool_recovery_waits_for_redis_instead_of_orphaning_live_jobs(redis_server_factory, tmp_path):
    """Regression (chaos soak, seed 61): a worker restarting while Redis restarted took the connection errors
    of its spool recovery for vanished jobs, uploaded three live jobs' renders as orphans and left the jobs
    `rendered` for good. Recovery now waits for Redis and records the render into its job."""
    from types import SimpleNamespace

    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC
    from worker.rq.record import submission_of
    from worker.stages.upload import UploadPipeline
    from worker.uploads.spool import Spool

    server = redis_server_factory(appendonly=True)
    conn = server.client(socket_timeout=2, socket_connect_timeout=2)
    job = Queue("q", connection=conn, serializer=JSONSerializer).enqueue(RENDER_FUNC, {"prompt": "t"})
    spool = Spool(tmp_path / "spool")
    spool.prepare(job.id, "video.mp4").write_bytes(b"video")
    spool.commit(job.id, file_name="video.mp4", key=f"videos/{job.id}/r/video.mp4", content_type="video/mp4",
                 submission=submission_of(job))  # fmt: skip
    queued: list = []
    pipeline = UploadPipeline(uploader=None, spool=spool, metrics=None, group="g", worker_name="w", threads=1,
                              max_pending=4, max_pending_bytes=1 << 20, outcomes=SimpleNamespace(relay=lambda j: None),
                              make_result=None, stop=threading.Event())  # fmt: skip
    pipeline.connection = conn
    pipeline.submit = lambda item: queued.append(item) or True
    server.kill()
    restart = threading.Timer(1.5, server.start)
    restart.start()
    try:
        assert pipeline.recover() == 1
    finally:
        restart.join()
    (item,) = queued
    assert item.attempt is not None and item.attempt.id == job.id  # recorded into its job, not uploaded as an orphan
