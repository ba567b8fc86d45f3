"""Spool, storage backends and the uploader against the real SeaweedFS server (no worker process)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest

from worker.settings import WorkerSettings
from worker.uploads.spool import MANIFEST_NAME, Spool
from worker.uploads.storage import LocalStorage, S3Storage, StorageError
from worker.uploads.uploader import Uploader, UploadFailed

MiB = 1024 * 1024


def _settings(s3_server, endpoint=None, **kw) -> WorkerSettings:
    return WorkerSettings(
        s3_endpoint_url=endpoint or s3_server.url,
        s3_bucket=s3_server.bucket,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_connect_timeout=1,
        **kw,
    )


def _render(spool: Spool, job_id: str, data: bytes, key: str) -> object:
    path = spool.prepare(job_id, "video.mp4")
    path.write_bytes(data)
    return spool.commit(job_id, file_name="video.mp4", key=key, content_type="video/mp4", queue="q")


# ==== spool =============================================================================================


def test_spool_commit_load_release_and_incomplete_renders(tmp_path):
    spool = Spool(tmp_path)
    data = os.urandom(10_000)
    entry = _render(spool, "job-1", data, "videos/job-1/video.mp4")
    assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.size == len(data)
    loaded = spool.load("job-1")
    assert loaded == entry
    assert [e.job_id for e in spool.pending()] == ["job-1"] and spool.usage() == (1, len(data))
    with pytest.raises(FileExistsError):
        spool.prepare("job-1", "video.mp4")  # a complete render is never overwritten
    spool.discard_incomplete("job-1")
    assert spool.load("job-1") is not None  # ... nor discarded as "incomplete"
    updated = spool.update(entry, attempts=2, last_error="boom")
    assert json.loads((tmp_path / "job-1" / MANIFEST_NAME).read_text())["attempts"] == 2
    assert spool.load("job-1") == updated
    spool.release(updated)
    assert spool.load("job-1") is None and not (tmp_path / "job-1").exists()
    # a render in progress (no manifest) is not pending and is removed by discard/prepare
    partial = spool.prepare("job-2", "video.mp4")
    partial.write_bytes(b"half")
    assert spool.load("job-2") is None and spool.pending() == []
    spool.prepare("job-2", "video.mp4")
    assert not partial.exists()
    spool.discard_incomplete("job-2")
    assert not (tmp_path / "job-2").exists()
    # a truncated file does not count as complete
    e3 = _render(spool, "job-3", b"x" * 100, "k")
    e3.path.write_bytes(b"x" * 50)
    assert spool.load("job-3") is None
    with pytest.raises(ValueError):
        spool.job_dir("../etc")


# ==== S3 ================================================================================================


def test_s3_put_small_and_multipart_with_sha256_and_idempotent_reuse(tmp_path, s3_server, s3_client, unique_name):
    settings = _settings(s3_server, upload_multipart_threshold=5 * MiB, upload_multipart_chunksize=5 * MiB,
                         s3_prefix=f"{unique_name}/")  # fmt: skip
    storage = S3Storage(settings)
    storage.check()
    spool = Spool(tmp_path)
    for job_id, size in (("small", 1000), ("big", 12 * MiB)):
        data = os.urandom(size)
        entry = _render(spool, job_id, data, storage.key_for(job_id, "r1", "video.mp4"))
        progress: list[int] = []
        stored = storage.put(entry, progress=progress.append)
        assert stored.key == f"{unique_name}/r1/{job_id}/video.mp4" and not stored.reused
        assert stored.sha256 == hashlib.sha256(data).hexdigest() and sum(progress) == size
        head = s3_client.head_object(Bucket=s3_server.bucket, Key=stored.key)
        assert head["Metadata"] == {"sha256": stored.sha256, "job-id": job_id}
        assert head["ContentType"] == "video/mp4" and head["ContentLength"] == size
        assert ("-" in head["ETag"]) == (size > 5 * MiB)  # multipart above the threshold
        assert s3_server.http_get(stored.url) == data
        again = storage.put(entry)  # a retry of the same job: no bytes sent, same object
        assert again.reused and again.sha256 == stored.sha256


def test_s3_presigned_url_is_signed_for_the_public_endpoint(tmp_path, s3_server, tcp_proxy_factory, unique_name):
    public = tcp_proxy_factory(s3_server.s3_port)  # what clients outside the service network would use
    storage = S3Storage(_settings(s3_server, s3_public_endpoint_url=public.url, s3_prefix=f"{unique_name}/"))
    entry = _render(Spool(tmp_path), "j", b"public bytes", storage.key_for("j", "r1", "video.mp4"))
    stored = storage.put(entry)
    assert stored.url.startswith(public.url + "/")
    assert s3_server.http_get(stored.url) == b"public bytes"  # the signature matches the public host


def test_s3_check_reports_missing_bucket_or_creates_it(s3_server, unique_name):
    missing = WorkerSettings(**{**_settings(s3_server).model_dump(), "s3_bucket": f"nb-{unique_name[-8:]}"})
    with pytest.raises(StorageError, match="bucket"):
        S3Storage(missing).check()
    created = WorkerSettings(**{**missing.model_dump(), "s3_create_bucket": True})
    S3Storage(created).check()
    S3Storage(missing).check()  # exists now


def test_s3_check_concurrent_creators_of_a_fresh_bucket_all_start(s3_server, unique_name):
    """Regression: workers of two groups start together against a fresh SeaweedFS; the ones that
    lost the CreateBucket race got BucketAlreadyOwnedByYou and exited 2. Each creator's first HeadBucket is
    held at a barrier until all have seen "no bucket", so every one of them goes on to CreateBucket."""
    n = 4
    settings = WorkerSettings(**{**_settings(s3_server).model_dump(), "s3_bucket": f"race-{unique_name[-8:]}",
                                 "s3_create_bucket": True})  # fmt: skip
    barrier = threading.Barrier(n, timeout=30)
    storages = [S3Storage(settings) for _ in range(n)]
    for storage in storages:
        real_head = storage.client.head_bucket
        seen = {"first": True}

        def head(*args, _real=real_head, _seen=seen, **kwargs):
            try:
                return _real(*args, **kwargs)
            finally:
                if _seen.pop("first", False):
                    barrier.wait()  # every creator has seen the bucket missing

        storage.client.head_bucket = head
    errors: list[BaseException] = []

    def start(storage: S3Storage) -> None:
        try:
            storage.check()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in storages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    S3Storage(settings).check()


@pytest.mark.parametrize("code", ["BucketAlreadyOwnedByYou", "BucketAlreadyExists"])
def test_s3_create_bucket_already_there_is_checked_not_fatal(code):
    """Unit: "already exists" from CreateBucket is success when a second HeadBucket answers, and a
    configuration error (not retryable, one line) when the bucket is someone else's."""
    from unittest import mock

    from botocore.exceptions import ClientError

    def error(c: str, status: int, op: str) -> ClientError:
        return ClientError({"Error": {"Code": c, "Message": c}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)

    settings = WorkerSettings(s3_endpoint_url="http://127.0.0.1:1", s3_bucket="videos", s3_create_bucket=True)
    storage = S3Storage(settings)
    storage.client = mock.Mock()
    storage.client.head_bucket.side_effect = [error("404", 404, "HeadBucket"), {}]
    storage.client.create_bucket.side_effect = error(code, 409, "CreateBucket")
    storage.check()
    assert storage.client.head_bucket.call_count == 2
    storage.client.head_bucket.side_effect = [error("404", 404, "HeadBucket"), error("403", 403, "HeadBucket")]
    with pytest.raises(StorageError, match="exists but this key cannot use it") as info:
        storage.check()
    assert not info.value.retryable
    storage.client.head_bucket.side_effect = [error("404", 404, "HeadBucket")]
    storage.client.create_bucket.side_effect = error("InvalidBucketName", 400, "CreateBucket")
    with pytest.raises(StorageError, match="cannot create it") as info:
        storage.check()
    assert not info.value.retryable


def test_s3_check_warns_when_urls_would_carry_the_workers_own_key(s3_server, caplog):
    """The no-Docker recipe set no LTX_S3_PRESIGN_*: every URL stored in Redis carried the worker's
    read/write key id, silently. The start-up check says so once; with a presign key it says nothing."""
    import logging

    with caplog.at_level(logging.WARNING, logger="worker.uploads.storage"):
        S3Storage(_settings(s3_server)).check()
    assert "LTX_S3_PRESIGN_ACCESS_KEY_ID_FILE" in caplog.text and s3_server.access_key not in caplog.text
    caplog.clear()
    presign = {"s3_presign_access_key_id": "ro-key", "s3_presign_secret_access_key": "ro-secret"}
    with caplog.at_level(logging.WARNING, logger="worker.uploads.storage"):
        S3Storage(_settings(s3_server, **presign)).check()
    assert "LTX_S3_PRESIGN" not in caplog.text


def test_s3_check_says_a_wrong_key_is_wrong(s3_server):
    """Regression: HeadBucket's 403 has no body, so the worker's start-up check said only "Forbidden"."""
    wrong = WorkerSettings(**{**_settings(s3_server).model_dump(), "s3_secret_access_key": "not-the-key"})
    with pytest.raises(StorageError, match="the endpoint refused the S3 key: check LTX_S3_ACCESS_KEY_ID") as info:
        S3Storage(wrong).check()
    assert "HeadBucket" in str(info.value) and not info.value.retryable and "not-the-key" not in str(info.value)


def test_local_storage_put_is_atomic_and_idempotent(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    storage.check()
    entry = _render(Spool(tmp_path / "spool"), "j", b"local video", storage.key_for("j", "r1", "video.mp4"))
    stored = storage.put(entry)
    assert (tmp_path / "store" / stored.key).read_bytes() == b"local video"
    assert stored.url.startswith("file://") and not stored.reused
    assert storage.put(entry).reused


# ==== uploader ==========================================================================================


def test_uploader_retries_while_s3_is_unreachable_then_releases_spool(tmp_path, s3_server, tcp_proxy_factory,
                                                                      unique_name):  # fmt: skip
    proxy = tcp_proxy_factory(s3_server.s3_port)
    storage = S3Storage(_settings(s3_server, endpoint=proxy.url, s3_prefix=f"{unique_name}/"))
    spool = Spool(tmp_path)
    entry = _render(spool, "j", os.urandom(50_000), storage.key_for("j", "r1", "video.mp4"))
    uploader = Uploader(storage, spool, attempts=10, backoff_s=0.2, backoff_max_s=0.5)
    events: list[dict] = []
    proxy.block()
    threading.Timer(1.5, proxy.unblock).start()
    t0 = time.monotonic()
    stored = uploader.upload(entry, on_event=events.append)
    assert time.monotonic() - t0 >= 1.0
    failures = [e for e in events if "error" in e]
    assert failures and all("retry_in_s" in e for e in failures)
    assert events[-1].get("done") is True
    assert stored.sha256 == entry.sha256
    assert spool.load("j") is None  # released only after the confirmed upload


def test_uploader_gives_up_keeping_the_video_and_honours_stop(tmp_path, s3_server, tcp_proxy_factory):
    proxy = tcp_proxy_factory(s3_server.s3_port)
    storage = S3Storage(_settings(s3_server, endpoint=proxy.url))
    spool = Spool(tmp_path)
    entry = _render(spool, "j", b"keep me", storage.key_for("j", "r1", "video.mp4"))
    proxy.block()
    uploader = Uploader(storage, spool, attempts=3, backoff_s=0.05, backoff_max_s=0.1)
    with pytest.raises(UploadFailed) as info:
        uploader.upload(entry)
    assert info.value.attempts == 3 and info.value.retryable
    kept = spool.load("j")
    assert kept is not None and kept.attempts == 3 and "failed" in kept.last_error
    assert kept.path.read_bytes() == b"keep me"
    stop = threading.Event()
    stop.set()
    with pytest.raises(UploadFailed, match="shutdown"):
        Uploader(storage, spool, attempts=5, backoff_s=10).upload(kept, stop=stop)
    assert spool.load("j") is not None
