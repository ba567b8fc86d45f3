"""The compose dashboard (rq-dashboard, the first client operators open), started with compose's own
entrypoint line against a real Redis that holds our jobs: the users file `ltx-worker redis-acl` writes,
the dashboard logged in as `worker` with its password read from a secret file, jobs enqueued by tenants
through `ProducerClient`.

Regressions: rq-dashboard 0.9.0 imports `six` without declaring it, and the image did not install it (the
dashboard stopped at start); and it was started without `--json`, so every job page answered 500
(`UnpicklingError: invalid load key '{'`: our jobs are JSON-serialized). The queue list, the job list
and each job's page must answer 200 and show our job.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.dev_servers import LOOPBACK, free_port, stop_process
from ltx_contract.redis_acl import AclUsers, generate
from tests.support.acl_stack import write_passwords
from tests.support.compose import SERVICES, stage_text
from tests.support.wait import wait_for


def _pinned(package: str) -> str:
    match = re.search(rf'"{package}==([^"]+)"', stage_text("dashboard"))
    assert match, f"the dashboard stage pins no {package}"
    return match.group(1)


def test_the_image_installs_what_rq_dashboard_imports_without_declaring() -> None:
    import rq_dashboard

    source = Path(rq_dashboard.__file__).parent / "web.py"
    assert re.search(r"^from six import", source.read_text(), re.M), "rq-dashboard no longer imports six?"
    assert _pinned("six")


class Dashboard:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace") + "\n" + self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Dashboard, Path]]:
    from devstack.dev_secure import SecureRedisServer
    from devstack.dev_servers import find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    installed = importlib.metadata.version("rq-dashboard")  # a dev dependency (pyproject), pinned like the image
    assert installed == _pinned("rq-dashboard"), (installed, _pinned("rq-dashboard"))
    tmp = tmp_path_factory.mktemp("dashboard")
    write_passwords(tmp / "secrets")
    server = SecureRedisServer(acl=generate(AclUsers(tenants=("alice", "bob")), password_dir=tmp / "secrets"))
    server.start()
    # compose's entrypoint, with the secret file, the Redis address and compose's `$$` escape resolved here
    script = SERVICES["dashboard"]["entrypoint"][-1]
    script = script.replace("$$", "$").replace("/run/secrets/redis_password", str(tmp / "secrets" / "worker"))
    script = script.replace("@redis:6379/", f"@{LOOPBACK}:{server.port}/")
    port = free_port()
    env = dict(os.environ, RQ_DASHBOARD_PORT=str(port), RQ_DASHBOARD_BIND=LOOPBACK)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # (its console script)
    log = tmp / "dashboard.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    dashboard = Dashboard(f"http://{LOOPBACK}:{port}", proc, log)
    try:

        def answering() -> bool:
            assert proc.poll() is None, f"rq-dashboard exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                return dashboard.get("/0/data/queues.json")[0] == 200
            except OSError:
                return False

        wait_for(answering, 60, "rq-dashboard answering", poll=0.2, on_fail=lambda: log.read_text()[-3000:])
        yield server, dashboard, tmp / "secrets"
    finally:
        stop_process(proc, 10)
        server.cleanup()


def test_the_queue_list_job_list_and_job_pages_show_our_jobs(stack: tuple[Any, Dashboard, Path]) -> None:
    from rq import Queue

    from ltx_contract.keys import tenant_queue
    from ltx_contract.schema import RenderRequest
    from producer.client import ProducerClient
    from producer.settings import ProducerSettings
    from worker.rq.loop.registries import register_queues

    server, dashboard, secrets = stack
    configured = f"q-{uuid.uuid4().hex[:8]}"
    queue = tenant_queue(configured, "alice")  # (alice submits to her own queue, which the workers register)
    with server.client() as admin:  # (as the worker serving it does when it starts: tenants may not)
        register_queues(admin, [Queue(queue, connection=admin)])
    settings = ProducerSettings(redis_url=server.url, redis_username="alice", redis_password_file=secrets / "alice",
                                queues=[configured])  # fmt: skip
    with ProducerClient(settings) as alice:
        alice.submit(RenderRequest(prompt="a dashboard prompt", width=64, height=64, num_frames=9), job_id="dash")
        alice.submit(RenderRequest(prompt="t", width=64, height=64, num_frames=9), job_id="gone")
        assert alice.cancel("gone") == "cancelled"

    status, body = dashboard.get("/0/data/queues.json")
    assert status == 200, body
    assert queue in [q["name"] for q in json.loads(body)["queues"]]
    status, body = dashboard.get("/0/view/queues")
    assert status == 200, body
    status, body = dashboard.get(f"/0/data/jobs/{queue}/queued/8/asc/1.json")
    assert status == 200, body
    # (a job cancelled while queued stays in the list until a worker dequeues and records it)
    assert [j["id"] for j in json.loads(body)["jobs"]] == ["alice-dash", "alice-gone"]
    status, body = dashboard.get(f"/0/view/jobs/{queue}/queued/8/asc/1")
    assert status == 200, body
    for job_id, rq_status in (("alice-dash", "queued"), ("alice-gone", "canceled")):
        status, body = dashboard.get(f"/0/view/job/{job_id}")
        assert status == 200 and job_id in body, body
        status, body = dashboard.get(f"/0/data/job/{job_id}.json")  # (the page's data: a 500 without --json)
        assert status == 200, body
        job = json.loads(body)
        assert (job["id"], job["origin"], job["status"]) == (job_id, queue, rq_status)
    assert "a dashboard prompt" in json.loads(dashboard.get("/0/data/job/alice-dash.json")[1])["description"]
