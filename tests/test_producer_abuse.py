"""The producer's tools against hostile or broken Redis contents and input files: one bad job
must not break `ls`/`stats` for everyone, and no input crashes the producer with a traceback.
Real Redis; the CLI through click's runner."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.exit_codes import ExitCode
from tests.support.cli import run


def _poison(redis_client, queue: str) -> list[str]:
    """Job hashes RQ cannot load, in the failed registry and the queue (as raw Redis access allows)."""
    q = Queue(queue, connection=redis_client, serializer=JSONSerializer)
    bad = {
        "bad-date": {"data": b"x", "created_at": "yesterday", "status": "failed", "origin": queue},
        "bad-data": {"data": b"\x00\xffnot zlib, not json", "status": "failed", "origin": queue},
        "bad-meta": {
            "data": json.dumps(["worker.job.render", None, [{}], {}]),
            "status": "failed",
            "origin": queue,
            "meta": "{not json",
            "enqueued_at": "never",
        },
    }
    for job_id, fields in bad.items():
        redis_client.hset(f"rq:job:{job_id}", mapping=fields)
        redis_client.zadd(q.failed_job_registry.key, {job_id: time.time() + 3600})
    redis_client.rpush(q.key, "bad-date")
    return list(bad)


def test_ls_and_stats_skip_unreadable_jobs_with_a_note(env, redis_client):
    queue = env["LTX_QUEUES"]
    ids = _poison(redis_client, queue)
    code, out, err = run(["ls"], env)
    assert code == 0, err
    assert out.count("unreadable") >= len(ids) and "skipped" in out
    code, out, err = run(["ls", "--json"], env)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["job_id"] for r in rows if r["state"] == "unreadable"} == set(ids)
    code, out, err = run(["stats", "--failures", "5"], env)
    assert code == 0, err
    assert "unreadable" in out
    code, out, err = run(["status", "bad-date"], env)
    assert code == ExitCode.NOT_FOUND and "cannot be read" in err, (out, err)


def test_a_deeply_nested_request_file_is_a_clear_error(env, tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    code, out, err = run(["submit", str(path)], env)
    assert code == ExitCode.USAGE and "nested too deeply" in err and "Traceback" not in err, (out, err)
    lines = tmp_path / "deep.jsonl"
    lines.write_text('{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    code, out, err = run(["submit", str(lines)], env)
    assert code == ExitCode.USAGE and "nested too deeply" in err, (out, err)


def _uploaded_job(redis_client, queue: str, result: dict) -> str:
    q = Queue(queue, connection=redis_client, serializer=JSONSerializer)
    job = q.create_job("worker.job.render", args=({"prompt": "t"},), meta={"state": "uploaded", "result": result})
    job.save()
    return job.id


def test_fetch_only_downloads_over_http_from_the_configured_endpoint(env, redis_client, tmp_path):
    from producer.client import FetchRefused, ProducerClient
    from producer.settings import load_settings

    secret = tmp_path / "secret.txt"
    secret.write_text("local file")
    settings = load_settings(redis_url=env["LTX_REDIS_URL"], s3_endpoint_url="http://127.0.0.1:8333")
    with ProducerClient(settings) as client:
        for url in (secret.as_uri(), "http://169.254.169.254/latest/meta-data?X-Amz-Signature=x",
                    "ftp://127.0.0.1:8333/x", "http://127.0.0.1:8334/videos/x"):  # fmt: skip
            job_id = _uploaded_job(redis_client, env["LTX_QUEUES"], {"url": url, "sha256": "0" * 64, "key": "k"})
            with pytest.raises(FetchRefused, match="refusing to fetch"):
                client.fetch(job_id, tmp_path / "out.mp4")
    assert not (tmp_path / "out.mp4").exists()
    # the local storage backend: file:// results are copied only from under LTX_LOCAL_STORAGE_DIR
    store = tmp_path / "store" / "videos" / "j"
    store.mkdir(parents=True)
    (store / "video.mp4").write_bytes(b"video")
    sha = hashlib.sha256(b"video").hexdigest()
    local = load_settings(redis_url=env["LTX_REDIS_URL"], local_storage_dir=str(tmp_path / "store"))
    with ProducerClient(local) as client:
        ok = _uploaded_job(redis_client, env["LTX_QUEUES"], {"url": (store / "video.mp4").as_uri(), "sha256": sha})
        assert client.fetch(ok, tmp_path / "got.mp4").sha256 == sha
        for outside in (secret.as_uri(), (store / ".." / ".." / ".." / "secret.txt").as_uri()):
            bad = _uploaded_job(redis_client, env["LTX_QUEUES"], {"url": outside, "sha256": sha})
            with pytest.raises(FetchRefused, match="refusing to fetch"):
                client.fetch(bad, tmp_path / "out.mp4")
        bad = _uploaded_job(redis_client, env["LTX_QUEUES"], {"path": str(secret), "sha256": sha})
        with pytest.raises(FetchRefused, match="refusing to fetch"):
            client.fetch(bad, tmp_path / "out.mp4")


def test_control_characters_from_other_clients_never_reach_the_terminal_raw(env, redis_client):
    hostile = "\x1b]0;pwned\x07\x1b[2Jfox\r\u202e"
    q = Queue(env["LTX_QUEUES"], connection=redis_client, serializer=JSONSerializer)
    meta = {"state": "failed", "fleet": "\x1b[31m", "error": {"reason": "x\x1b[5m", "message": hostile}}
    job = q.enqueue("worker.job.render", {"prompt": hostile}, meta=meta)
    for command in (["ls"], ["status", job.id], ["stats"]):
        _, out, _ = run(command, env)
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, (command, out)
    _, out, _ = run(["ls"], env)
    assert "\\x1b" in out


def test_clients_see_and_act_on_their_own_jobs_and_operators_on_all(env, tmp_path):
    request = tmp_path / "r.json"
    request.write_text(json.dumps({"prompt": "alice's secret prompt", "width": 64, "height": 64, "num_frames": 9}))
    alice, bob = {**env, "LTX_CLIENT": "alice"}, {**env, "LTX_CLIENT": "bob"}
    code, out, err = run(["submit", str(request)], alice)
    assert code == 0, err
    job_id = out.strip()
    code, out, _ = run(["ls"], bob)
    assert code == 0 and job_id not in out and "secret" not in out
    for command in (["status", job_id], ["cancel", job_id], ["fetch", job_id, "-o", str(tmp_path / "x.mp4")],
                    ["watch", job_id]):  # fmt: skip
        code, out, err = run(command, bob)
        assert code == ExitCode.NOT_FOUND and "another client" in err, (command, out, err)
    code, out, _ = run(["ls"], alice)
    assert job_id in out
    code, out, _ = run(["ls"], {**bob, "LTX_OPERATOR": "true"})
    assert job_id in out
    code, out, err = run(["cancel", job_id], {**bob, "LTX_OPERATOR": "true"})
    assert code == 0, err


def test_the_client_name_is_checked_at_the_api(env):
    from ltx_contract.schema import RenderRequest
    from producer.client import ProducerClient
    from producer.settings import load_settings

    with ProducerClient(load_settings(redis_url=env["LTX_REDIS_URL"], queues=[env["LTX_QUEUES"]])) as client:
        for bad in ("x" * 10_000, "x:*\nFAKE", "a b"):
            with pytest.raises(ValueError, match="client name"):
                client.submit(RenderRequest(prompt="t"), client=bad)


def test_an_image_format_that_cannot_be_sized_is_refused_at_submit(env, redis_client, tmp_path: Path):
    """The edge half of the image-format check (the worker's: tests/test_worker_abuse.py): nothing enqueued."""
    import base64

    tiff = b"II*\x00\x08\x00\x00\x00" + b"\x00" * 64
    request = {"prompt": "t", "images": [{"data": base64.b64encode(tiff).decode()}]}
    path = tmp_path / "tiff.json"
    path.write_text(json.dumps(request))
    queue = Queue(env["LTX_QUEUES"], connection=redis_client, serializer=JSONSerializer)
    before = queue.count
    code, out, err = run(["submit", str(path)], env)
    assert code == ExitCode.USAGE, (out, err)
    assert "not a PNG, JPEG, WebP, GIF or BMP file" in err and "Traceback" not in err, err
    assert queue.count == before
