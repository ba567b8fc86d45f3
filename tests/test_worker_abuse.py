"""A hostile or careless client against a real worker: real Redis, real S3 (SeaweedFS), one
`ltx-worker one` process with a CPU fleet running the fault-injection runner.

Each test is one attack of the issue; it asserts the worker ends the job with a recorded outcome after a
bounded number of attempts and stays up with its fleet warm.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
from rq import Retry
from rq.job import JobStatus

from tests.support.fleet import JobFleet, running_worker
from tests.support.wait import wait_for
from tests.support.workers import enqueue, events, wait_rq_status, wait_state

pytestmark = pytest.mark.timeout(240)


class Worker(JobFleet):
    """Handle on the module's worker (no S3 proxy)."""

    tmpfs = False  #: the spool is a small tmpfs of its own (a test may fill it)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("abuse")
    spool = tmp / "spool"
    spool.mkdir()
    # A small tmpfs (if this user may mount one) lets a test fill the spool's disk for real.
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=400", "tmpfs", str(spool)]
    tmpfs = os.geteuid() == 0 and subprocess.run(mount, check=False, capture_output=True).returncode == 0
    try:
        with running_worker(tmp, redis_server, s3_server, handle=Worker, retry_fleet_failure=1,
                            retry_upload_failed=1, spool_min_free_bytes=1 << 20) as w:  # fmt: skip
            w.tmpfs = tmpfs
            yield w
    finally:
        if tmpfs:
            subprocess.run(["umount", "-l", str(spool)], check=False)  # (lazy: never leave a mount behind)


def _states(conn: Any, job_id: str) -> list[str]:
    return [e["state"] for e in events(conn, job_id) if e["type"] == "state"]


def _enqueue_edited(worker: Worker, fields: dict[str, Any], **kwargs: Any) -> Any:
    """A job whose hash a client edited (as raw Redis access allows) before the worker can see it."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC

    q = Queue(worker.queue, connection=worker.conn, serializer=JSONSerializer)
    request = {"prompt": "t", "width": 64, "height": 64, "num_frames": 9}
    job = q.create_job(RENDER_FUNC, args=(request,), timeout=600, result_ttl=3600, failure_ttl=3600, **kwargs)
    job.save()
    worker.conn.hset(job.key, mapping={"status": "queued", **fields})
    q.push_job_id(job.id)
    return job


def _wait_failed(worker: Worker, job: Any, timeout: float = 30) -> dict[str, Any]:
    wait_rq_status(job, {JobStatus.FAILED}, timeout, worker.proc)
    time.sleep(1.0)  # long enough for an endless re-queue loop to show itself
    assert job.get_status(refresh=True) == JobStatus.FAILED
    meta = job.get_meta(refresh=True)
    assert meta["state"] == "failed", meta
    return meta


# ==== item 1: every failure path ends in a recorded outcome, after a bounded number of attempts ==========


def test_overlong_job_id_fails_once_with_a_reason_and_is_counted(worker):
    worker.idle()
    before = worker.metric('ltx_worker_jobs_total{group="cpu:1",outcome="failed",reason="invalid_request"}')
    job = worker.enqueue(job_id="x" * 300)
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request", meta["error"]
    assert "job id" in meta["error"]["message"]
    assert _states(worker.conn, job.id).count("started") <= 1
    assert "retrying" not in _states(worker.conn, job.id)
    after = worker.metric('ltx_worker_jobs_total{group="cpu:1",outcome="failed",reason="invalid_request"}')
    assert after == before + 1
    worker.idle()


def test_the_client_api_refuses_an_overlong_job_id_or_meta_before_redis(worker, redis_server):
    from ltx_contract.schema import RenderRequest
    from producer.client import ProducerClient
    from producer.settings import ProducerSettings

    with ProducerClient(ProducerSettings(redis_url=redis_server.url, queues=[worker.queue])) as client:
        for bad in ("x" * 129, "a/b", "x\nFAKE", ""):
            with pytest.raises(ValueError, match="job id"):
                client.submit(RenderRequest(prompt="t"), job_id=bad)
        with pytest.raises(ValueError, match="meta"):
            client.submit(RenderRequest(prompt="t"), extra_meta={"pad": "x" * (1 << 20)})
    assert worker.conn.llen(f"rq:queue:{worker.queue}") == 0


def test_a_spool_error_is_a_failure_with_its_errno_retried_within_its_budget(worker):
    worker.idle()
    job_id = f"spool-{uuid.uuid4().hex[:8]}"
    worker.spool.mkdir(parents=True, exist_ok=True)
    (worker.spool / job_id).write_text("not a directory")  # the job's spool directory cannot be made
    try:
        job = worker.enqueue(job_id=job_id)
        meta = _wait_failed(worker, job)
    finally:
        (worker.spool / job_id).unlink()
    assert meta["error"]["reason"] == "spool_error" and meta["error"]["errno"] == "EEXIST", meta["error"]
    assert [a["reason"] for a in meta["attempts"]] == ["spool_error", "spool_error"]  # retry_spool_error=1
    assert _states(worker.conn, job.id).count("started") == 2
    assert worker.idle()["fleet"]["alive"]


def test_a_full_spool_disk_engages_back_pressure_until_space_comes_back(worker):
    """A full spool disk failed every job (`No space left on device`, re-queued without end)."""
    if not worker.tmpfs:
        pytest.skip("needs a tmpfs for the spool (mount: root only)")
    worker.idle()
    filler = worker.spool / "filler"
    filler.mkdir()
    try:
        for i in range(10_000):  # use up the tmpfs's inodes: no job directory could be created
            try:
                (filler / str(i)).touch()
            except OSError:
                break
        job = worker.enqueue()
        wait_for(lambda: worker.health()["uploads"]["backpressure"], 30, "back-pressure", on_fail=worker.proc.log_tail)
        time.sleep(2)
        assert job.get_status(refresh=True) == JobStatus.QUEUED  # waits: neither taken nor failed
        assert worker.metric('ltx_worker_backpressure{group="cpu:1"}') == 1
    finally:
        subprocess.run(["rm", "-rf", str(filler)], check=True)
    wait_rq_status(job, {JobStatus.FINISHED}, 60, worker.proc)
    assert not worker.health()["uploads"]["backpressure"]


def test_the_hard_cap_on_attempts_holds_whatever_the_hash_says(worker):
    """A hash that claims many executions (or a loop that re-queued it that often) is never run again,
    and a client's `retries_left` never re-queues a job nobody decided to retry."""
    worker.idle()
    job = _enqueue_edited(worker, {"retries_left": 1_000_000}, meta={"attempt": 5})  # the default cap: 5
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "attempts_exhausted" and meta["error"]["retryable"] is False, meta
    junk = worker.enqueue(meta={"attempt": "many"})  # junk counts as the cap, never as zero
    assert _wait_failed(worker, junk)["error"]["reason"] == "attempts_exhausted"
    refused = _enqueue_edited(worker, {"data": zlib.compress(json.dumps(["os.getcwd", None, [], {}]).encode())},
                              retry=Retry(max=1000))  # fmt: skip
    assert _wait_failed(worker, refused)["error"]["reason"] == "invalid_request"
    assert _states(worker.conn, refused.id) == ["failed"]


def test_an_ended_job_pushed_again_never_re_runs_and_junk_ids_count_for_nobody(worker):
    """Without tenant users anyone may push ids: a failed job's id pushed again rendered it again (RQ's
    dequeue never looks at the status). The worker drops it (`not_queued`) and ids without a hash
    (`no_job`), uncounted, and says so in its metrics."""
    worker.idle()
    metric = 'ltx_worker_dropped_queue_entries_total{group="cpu:1",reason="%s"}'
    before = {r: worker.metric(metric % r) for r in ("not_queued", "no_job")}
    job = worker.enqueue("t error=runner")
    _wait_failed(worker, job)
    worker.conn.rpush(f"rq:queue:{worker.queue}", job.id, job.id, "no-such-job")
    probe = worker.enqueue("t")
    wait_state(probe, "uploaded", 60, worker.proc)
    assert _states(worker.conn, job.id).count("started") == 1 and job.get_status(refresh=True) == JobStatus.FAILED
    assert {r: worker.metric(metric % r) - n for r, n in before.items()} == {"not_queued": 2, "no_job": 1}
    assert worker.conn.llen(f"rq:queue:{worker.queue}:intermediate") == 0


# ==== item 2: the worker owns timeouts and TTLs =========================================================


@pytest.mark.parametrize("job_timeout", [1, 31])
def test_a_client_job_timeout_neither_times_out_the_job_nor_rebuilds_the_fleet(worker, job_timeout):
    pids = worker.idle()["fleet"]["pids"]
    job = worker.enqueue("t step_s=0.5", job_timeout=job_timeout)  # a 1 s render
    wait_rq_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 60, worker.proc)
    meta = job.get_meta(refresh=True)
    assert job.get_status(refresh=True) == JobStatus.FINISHED, meta.get("error")
    assert int(worker.conn.hget(job.key, "timeout")) == 3600 + 30  # the worker's render timeout + 30 s
    assert worker.idle()["fleet"]["pids"] == pids  # no rebuild


def test_client_ttls_are_capped_by_the_worker(worker):
    worker.idle()
    ok = worker.enqueue(result_ttl=10**9, failure_ttl=10**9)
    wait_rq_status(ok, {JobStatus.FINISHED}, 60, worker.proc)
    bad = worker.enqueue("t error=runner", result_ttl=-1, failure_ttl=10**9)
    _wait_failed(worker, bad)
    with contextlib.suppress(AssertionError):  # (at most 10 s: the TTLs below are checked either way)
        wait_for(lambda: not (m := worker.conn.hget(ok.key, "meta")) or "uploaded" in str(m), 10, "ok settled",
                 poll=0.1)  # fmt: skip
    assert 0 < worker.conn.ttl(ok.key) <= 86400  # LTX_RESULT_TTL's default
    assert 0 < worker.conn.ttl(bad.key) <= 7 * 86400  # LTX_FAILURE_TTL's default
    assert 0 < worker.conn.ttl(f"ltx:job:{bad.id}:events") <= 7 * 86400


# ==== item 3: RQ's pubsub shutdown command does not stop the service =====================================


def test_rq_shutdown_commands_and_junk_on_pubsub_are_ignored_and_cancels_still_work(worker):
    from rq.command import send_shutdown_command

    from ltx_contract.control import cancel_job

    pid = worker.idle()["pid"]
    rq_name = worker.health()["worker"]
    for _ in range(5):
        send_shutdown_command(worker.conn, rq_name)
    worker.conn.publish(f"rq:pubsub:{rq_name}", b"\x00not json")  # used to end RQ's pubsub thread
    time.sleep(2)
    assert worker.proc.proc.poll() is None and worker.idle()["pid"] == pid
    assert worker.metric('ltx_worker_ignored_commands_total{command="shutdown"') == 5
    assert worker.metric('ltx_worker_ignored_commands_total{command="invalid"') == 1
    job = worker.enqueue("t step_s=0.5 steps=20")
    wait_state(job, "rendering", 30, worker.proc)
    assert cancel_job(worker.conn, job.id) == "stop_requested"  # (RQ's stop-job command over pubsub)
    wait_state(job, "cancelled", 30, worker.proc)


# ==== item 4: job-hash fields beyond the function name are not trusted ====================================


def canary(job: Any, *args: Any) -> None:
    """Named as a callback by a hostile hash: it must never run."""
    Path(job.meta["canary"]).touch()


@pytest.mark.parametrize(
    "fields",
    [
        {"failure_callback_name": "tests.test_worker_abuse.canary"},
        {"success_callback_name": "tests.test_worker_abuse.canary"},
        {"stopped_callback_name": "tests.test_worker_abuse.canary"},
        {"repeats_left": 1000, "repeat_intervals": "[0]"},
        {"webhooks": json.dumps([{"url": "http://127.0.0.1:9/x"}])},
    ],
    ids=["failure_callback", "success_callback", "stopped_callback", "repeats", "webhooks"],
)
def test_a_hash_with_callbacks_repeats_or_webhooks_is_refused_and_none_of_them_runs(worker, tmp_path, fields):
    worker.idle()
    target = tmp_path / "canary"
    job = _enqueue_edited(worker, fields, meta={"canary": str(target)})
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and "never sets" in meta["error"]["message"], meta
    time.sleep(0.5)
    assert not target.exists()
    assert _states(worker.conn, job.id) == ["failed"]  # refused before it ran, once


def test_a_zlib_bomb_in_data_is_refused_without_inflating_it(worker):
    worker.idle()
    call = b'["worker.job.render", null, [{"prompt": "' + b"a" * (64 << 20) + b'"}], {}]'
    bomb = zlib.compress(call, 9)  # ~64 KB that inflates to 64 MB
    job = _enqueue_edited(worker, {"data": bomb})
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and "data exceeds" in meta["error"]["message"], meta


@pytest.mark.parametrize(
    "data",
    [b"\x00\xffnot zlib, not json", zlib.compress(b"zlib, not json"), zlib.compress(b'["worker.job.render"]')],
    ids=["not-zlib", "zlib-not-json", "not-a-call"],
)
def test_data_that_is_not_a_call_is_refused_as_invalid_request(worker, data):
    """Data RQ cannot unpack into a call used to fail as `internal` (RQ's DeserializationError): it is the
    client's hash, so it is the client's error, refused before the job function like any other."""
    worker.idle()
    job = _enqueue_edited(worker, {"data": data})
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and "data is not a call" in meta["error"]["message"], meta
    assert _states(worker.conn, job.id) == ["failed"]


@pytest.mark.parametrize(
    "fields",
    [{"created_at": "garbage"}, {"enqueued_at": "yesterday"}, {"timeout": "soon"}, {"worker_name": b"\xff\xfe"}],
    ids=["created_at", "enqueued_at", "timeout", "worker_name"],
)
def test_a_field_rq_cannot_parse_ends_the_job_failed_in_rq_and_in_its_recorded_state(worker, redis_server, fields):
    """A hash RQ could not load was failed in RQ's records only (`fail_unreadable`): its meta (the state
    `producer status` and `watch` report) stayed `queued` for ever. Now the field is dropped and the job
    refused like any other: RQ's status, the meta and the stream all say `failed`, and the client can read it."""
    from producer.client import ProducerClient
    from producer.settings import ProducerSettings

    worker.idle()
    job = _enqueue_edited(worker, fields, meta={"state": "queued", "client": "alice"})
    meta = _wait_failed(worker, job)
    (name,) = fields
    assert meta["error"]["reason"] == "invalid_request" and f"hash's {name} is not" in meta["error"]["message"]
    assert _states(worker.conn, job.id) == ["failed"]
    settings = ProducerSettings(redis_url=redis_server.url, queues=[worker.queue], client="alice")
    with ProducerClient(settings) as client:
        info = client.status(job.id)
    assert (info.state, info.rq_status, info.error["reason"]) == ("failed", "failed", "invalid_request"), info
    after = worker.enqueue("after an unparseable hash")
    assert wait_state(after, {"uploaded", "failed"}, 60, worker.proc) == "uploaded"


def test_an_oversized_meta_is_refused_and_not_rewritten_on_every_event(worker):
    worker.idle()
    job = worker.enqueue(meta={"pad": "x" * (1 << 20)})
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and "meta" in meta["error"]["message"], meta
    assert len(worker.conn.hget(job.key, "meta")) < 64 << 10


def test_an_oversized_job_hash_is_refused_unread_and_its_memory_freed(worker):
    """A tenant may write what she likes into her own job hash (here 9 MB; each value under Redis's 4 MB
    bulk cap): the worker refuses it by its size in Redis, without reading it, and deletes it."""
    worker.idle()
    job = _enqueue_edited(worker, {f"pad{i}": b"y" * (3 << 20) for i in range(3)})
    wait_rq_status(job, {JobStatus.FAILED}, 30, worker.proc)
    assert worker.conn.hget(job.key, "pad0") is None and worker.conn.memory_usage(job.key, samples=0) < 64 << 10
    assert b"over" in worker.conn.hget(job.key, "exc_info")
    assert wait_state(worker.enqueue("after an oversized hash"), {"uploaded", "failed"}, 60, worker.proc) == "uploaded"


# ==== item 7 (inputs): image dimensions are checked before anything decodes the image =====================


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares this size (its pixel data is never reached: only the header is read)."""
    import struct

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def test_an_image_declaring_huge_dimensions_is_refused_before_decoding(worker):
    import base64

    worker.idle()
    image = {"data": base64.b64encode(_png_header(16000, 16000) + b"\x00" * 64).decode(), "frame": 0}
    job = enqueue(worker.conn, worker.queue, {"prompt": "t", "width": 64, "height": 64, "num_frames": 9,
                                              "images": [image]})  # fmt: skip
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and meta["error"]["field"] == "images.0.data", meta
    assert "16000x16000" in meta["error"]["message"]


def test_an_image_format_that_cannot_be_sized_is_refused_and_the_fleet_stays_warm(worker):
    """Regression: formats `ltx_mgpu.spec.image_size` cannot read (TIFF here) reached the runner's decoder
    unchecked."""
    import base64

    tiff = b"II*\x00" + b"\x08\x00\x00\x00" + b"\x00" * 64  # a TIFF header: no size the check can read
    pids = worker.idle()["fleet"]["pids"]
    image = {"data": base64.b64encode(tiff).decode(), "frame": 0}
    job = enqueue(worker.conn, worker.queue, {"prompt": "t", "width": 64, "height": 64, "num_frames": 9,
                                              "images": [image]})  # fmt: skip
    meta = _wait_failed(worker, job)
    assert meta["error"]["reason"] == "invalid_request" and meta["error"]["field"] == "images.0.data", meta
    assert "not a PNG, JPEG, WebP, GIF or BMP file" in meta["error"]["message"]
    assert meta["error"]["retryable"] is False and len(meta["attempts"]) == 1
    assert worker.idle()["fleet"]["pids"] == pids  # the fleet never saw it: no rebuild


# ==== item 6 (tenancy): a presigned URL never outlives the result it is recorded in =========================


def test_a_reused_job_id_gets_its_own_object_and_the_first_stays_unchanged(worker, s3_server):
    """Regression: keys were `videos/<id>/video.mp4`, so a job id reused after the first job expired (or was
    deleted) overwrote the first submission's video under the first owner's still-valid URL."""
    import hashlib

    worker.idle()
    job_id = f"reused-{uuid.uuid4().hex[:8]}"
    request = {"prompt": "t", "width": 64, "height": 64, "num_frames": 9}
    first = enqueue(worker.conn, worker.queue, {**request, "seed": 1}, job_id=job_id)
    wait_state(first, "uploaded", 60, worker.proc)
    one = first.get_meta(refresh=True)["result"]
    s3 = s3_server.client()
    first.delete()  # (what expiry does to the hash; the id is free again)
    second = enqueue(worker.conn, worker.queue, {**request, "seed": 2}, job_id=job_id)
    wait_state(second, "uploaded", 60, worker.proc)
    two = second.get_meta(refresh=True)["result"]
    assert one["sha256"] != two["sha256"]  # two different videos ...
    assert one["key"] != two["key"], (one["key"], two["key"])
    assert one["key"].startswith("videos/") and one["key"].endswith(f"/{job_id}/video.mp4"), one["key"]
    for result in (one, two):  # ... each whole under its own key
        body = s3.get_object(Bucket=result["bucket"], Key=result["key"])["Body"].read()
        assert hashlib.sha256(body).hexdigest() == result["sha256"]
    assert hashlib.sha256(s3_server.http_get(one["url"])).hexdigest() == one["sha256"]  # the first owner's URL


def test_a_reused_job_id_never_takes_over_an_earlier_submissions_render_left_in_the_spool(worker):
    """Regression: the spool is keyed by job id, so a render an earlier submission left there (its upload
    failed for good; the job has since expired) was uploaded as the video of a new job reusing the id."""
    import hashlib

    from worker.uploads.spool import Spool

    worker.idle()
    job_id = f"reused-{uuid.uuid4().hex[:8]}"
    spool = Spool(worker.spool)
    stale = b"a video of an earlier submission" * 100
    spool.prepare(job_id, "video.mp4").write_bytes(stale)
    spool.commit(job_id, file_name="video.mp4", key=f"videos/0123456789abcdef/{job_id}/video.mp4",
                 content_type="video/mp4", submission="2020-01-01T00:00:00.000000Z")  # fmt: skip
    job = enqueue(worker.conn, worker.queue, {"prompt": "t", "width": 64, "height": 64, "num_frames": 9},
                  job_id=job_id)  # fmt: skip
    wait_state(job, "uploaded", 60, worker.proc)
    result = job.get_meta(refresh=True)["result"]
    assert result["sha256"] != hashlib.sha256(stale).hexdigest()  # rendered for this job, not taken over
    rendered = [e for e in events(worker.conn, job_id) if e["type"] == "state" and e["state"] == "rendered"]
    assert rendered and not any(e.get("resumed_from_spool") for e in rendered), rendered
    wait_for(lambda: spool.load(job_id) is None, 10, "the spool released after the upload")  # stale one gone


@pytest.mark.parametrize(("result_ttl", "kept"), [(600, 600), (10**9, 86400)])  # (capped: LTX_RESULT_TTL)
def test_presigned_urls_expire_with_the_result(worker, s3_server, result_ttl, kept):
    worker.idle()
    job = worker.enqueue(result_ttl=result_ttl)
    wait_state(job, "uploaded", 60, worker.proc)
    result = job.get_meta(refresh=True)["result"]
    assert f"X-Amz-Expires={kept}" in result["url"], result["url"]
    assert result["url_expires_at"] <= time.time() + kept
    assert s3_server.http_get(result["url"])  # still a working URL
