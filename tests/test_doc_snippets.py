"""The Python snippets of the docs, run as written against a real Redis, a real SeaweedFS and a worker
(CPU fleet, fault runner): only the documented addresses are replaced by the test servers'.

Regressions: worker.md's raw-RQ snippet used a `redis` it never defined (NameError), and producer.md's
Python API snippet's `fetch` refused to download because its settings named no S3 endpoint.
The shell blocks run in `tests/test_doc_stack.py` (on a live stack) and `tests/test_doc_recipes.py` (Redis ACL/TLS).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.workers import ROOT, WorkerProcess, worker_env
from tests.test_redis_restart import wait_listening

DOCS = ROOT / "docs"
DOC_REDIS, DOC_S3 = "redis://127.0.0.1:6379/0", "http://127.0.0.1:8333"


def python_block(page: str, after: str) -> str:
    """The first ```python block after the heading or sentence `after` in docs/`page`."""
    text = (DOCS / page).read_text()
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start : text.index("```", start)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Iterator[tuple[Any, Any]]:
    from devstack.dev_servers import RedisServer, find_redis_server
    from producer.settings import ProducerSettings

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    tmp = tmp_path_factory.mktemp("snippets")
    server = RedisServer().start()
    queue = ProducerSettings.model_fields["queues"].get_default(call_default_factory=True)[0]  # (the default queue)
    spool = tmp / "spool"
    spool.mkdir()
    env = worker_env(server.url, s3_server, queue=queue, name=f"d{uuid.uuid4().hex[:6]}", spool=spool)
    worker = WorkerProcess(["one", "--group", "cpu:1"], env, tmp / "worker.log").start()
    try:
        wait_listening(server.client(), env["LTX_WORKER_NAME"], worker)
        yield server, worker
    finally:
        rc = worker.stop()
        server.cleanup()
        assert rc == 0, worker.log_tail()


def run_snippet(code: str, server: Any, s3_url: str, cwd: Path, epilogue: str = "") -> str:
    code = code.replace(DOC_REDIS, server.url).replace(DOC_S3, s3_url) + epilogue
    env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=180, check=False)  # fmt: skip
    assert out.returncode == 0, f"the snippet failed:\n{code}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def test_worker_md_raw_rq_snippet_enqueues_a_job_the_worker_renders(stack: tuple[Any, Any], s3_server: Any,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    server, worker = stack
    code = python_block("worker.md", "## Submitting a job")
    wait = (  # (the service's state: the upload ends after RQ's `finished`)
        "\nimport time\n"
        "for _ in range(600):\n"
        "    if job.get_meta(refresh=True).get('state') in ('uploaded', 'failed'):\n        break\n"
        "    time.sleep(0.2)\n"
        "print(job.id, job.get_status().value, job.get_meta().get('state'))\n"
    )
    out = run_snippet(code, server, s3_server.url, tmp_path, wait)
    assert out.split()[1:] == ["finished", "uploaded"], out + worker.log_tail()


def test_producer_md_python_api_snippet_submits_follows_and_fetches(stack: tuple[Any, Any], s3_server: Any,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    server, worker = stack
    code = python_block("producer.md", "## Python API")
    out = run_snippet(code, server, s3_server.url, tmp_path, "\nprint('state', info.state)\n")
    assert re.search(r"^state uploaded$", out, re.M), out + worker.log_tail()
    assert (tmp_path / "fox.mp4").stat().st_size > 0
