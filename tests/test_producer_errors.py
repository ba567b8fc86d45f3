"""Every producer error is one line with its documented exit code, through the real CLI
against real servers: a Redis with a password, a database index it does not have, a SeaweedFS S3 port
and a tiny TCP server that answers garbage where Redis should be, a port nobody listens on; a wrong S3 key
against SeaweedFS.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from rq.job import Job
from rq.serializers import JSONSerializer

from devstack.ports import free_port
from ltx_contract.schema import RenderRequest
from ltx_contract.states import JobState
from producer.cli import cli
from producer.client import ProducerClient
from producer.display import printable
from producer.exit_codes import ExitCode
from producer.settings import load_settings
from tests.support.wait import wait_for
from worker.ops.logs import event_text

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "s3cret-pw"


def one_line(err: str) -> str:
    """The single stderr line (asserts there is exactly one, and no traceback)."""
    assert err.count("\n") == 1 and err.startswith("producer: "), err
    assert "Traceback" not in err
    return err.strip()


def run(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def secured(redis_server_factory) -> Any:
    """A Redis that asks for a password, and a `noperm` user that may run nothing."""
    server = redis_server_factory()
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "noperm", "on", f">{PASSWORD}", "~*", "-@all")
        admin.config_set("requirepass", PASSWORD)
    return server


@pytest.fixture
def garbage_port() -> Iterator[int]:
    """A TCP listener that answers anything with a line that is not Redis' protocol."""
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        listener.close()
        thread.join(5)


# (case, what the line must say, whether the settings are wrong: a dry run then exits 6 too)
CASES = [
    ("db-index", "has no database 99", True),
    ("wrong-password", "Redis authentication failed", True),
    ("no-password", "requires authentication (NOAUTH)", True),
    ("noperm", "NOPERM", True),
    ("s3-port", "does not speak the Redis protocol", True),
    ("garbage", "does not speak the Redis protocol", True),
    ("refused", "cannot reach Redis", False),
]


def _url(case: str, secured: Any, garbage: int, s3_server: Any) -> str:
    port = secured.port
    return {
        "db-index": f"redis://:{PASSWORD}@127.0.0.1:{port}/99",
        "wrong-password": f"redis://:nope@127.0.0.1:{port}/0",
        "no-password": f"redis://127.0.0.1:{port}/0",
        "noperm": f"redis://noperm:{PASSWORD}@127.0.0.1:{port}/0",
        "s3-port": f"redis://127.0.0.1:{s3_server.s3_port}/0",
        "garbage": f"redis://127.0.0.1:{garbage}/0",
        "refused": f"redis://127.0.0.1:{free_port()}/0",
    }[case]


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[2] and c[0] != "garbage"])
def test_the_worker_refuses_wrong_redis_settings_in_the_producers_words(
    case: str, secured, garbage_port, s3_server, tmp_path: Path, unique_name: str
) -> None:
    """A wrong database was "Redis at URL refused us (LTX_REDIS_URL): DB index is out of range" from the
    worker and "Redis at URL has no database 99 (...): fix the /N at the end of LTX_REDIS_URL" from the
    producer; credentials differed the same way. One function words both now
    (`ltx_contract.redis_conn.redis_problem`): the worker exits 2 with the producer's very line."""
    from tests.support.workers import worker_env

    url = _url(case, secured, garbage_port, s3_server)
    code, _, err = run(["ls"], {"LTX_REDIS_URL": url, "LTX_QUEUES": f"q-{unique_name}"})
    said = one_line(err).removeprefix("producer: ")
    spool = tmp_path / "spool"
    env = worker_env(url, s3_server, queue=f"q-{unique_name}", name="wrongdb", spool=spool, log_format="text")
    cmd = [sys.executable, "-m", "worker", "one", "--group", "cpu:1"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False, text=True, timeout=120)
    output = res.stdout + res.stderr
    assert (code, res.returncode) == (ExitCode.UNAVAILABLE, 2), output
    command = re.compile(r"run the '\w+' command")  # (NOPERM names the command each ran first: ls, PING)
    assert command.sub("", said) in command.sub("", output) and PASSWORD not in output, (said, output)


@pytest.mark.parametrize(("case", "says", "misconfigured"), CASES, ids=[c[0] for c in CASES])
def test_a_redis_problem_is_one_line_and_exit_6_for_every_command(
    case: str, says: str, misconfigured: bool, secured, garbage_port, s3_server, tmp_path: Path, unique_name: str
) -> None:
    """Regression: a wrong DB index or a non-Redis port gave a 63-line traceback for ls/submit/stats/backfill
    and "exists but cannot be read" (exit 5) for status/watch/cancel/fetch; bad credentials read "cannot
    reach Redis"."""
    env = {"LTX_REDIS_URL": _url(case, secured, garbage_port, s3_server), "LTX_QUEUES": f"q-{unique_name}"}
    request = tmp_path / "p.json"
    request.write_text('{"prompt": "x"}')
    for command in (["ls"], ["stats"], ["submit", str(request)], ["status", "x"], ["watch", "x"],
                    ["cancel", "x"], ["fetch", "x", "-o", str(tmp_path / "x.mp4")]):  # fmt: skip
        code, out, err = run(command, env)
        assert code == ExitCode.UNAVAILABLE, (command, code, out, err)
        assert out in ("", f"{out[:8]} watching x\n"), (command, out)  # (watch says what it watches first)
        assert says in one_line(err), (command, err)
        assert PASSWORD not in err
    code, out, err = run(["submit", str(request), "--dry-run"], env)
    if misconfigured:
        assert (code, out) == (ExitCode.UNAVAILABLE, ""), err
        assert says in one_line(err)
    else:  # unreachable: the file is still validated offline (documented)
        assert code == 0 and out.strip().endswith(": ok") and "runner limits not checked" in one_line(err)


@pytest.mark.parametrize("case", ["wrong-password", "refused"])
def test_backfill_fails_at_once_when_redis_is_unusable_at_start(
    case: str, secured, garbage_port, s3_server, tmp_path: Path, unique_name: str
) -> None:
    """Regression: `backfill` retried for 5 minutes on wrong credentials or an unreachable Redis at start,
    where every other command exits 6 at once (a later outage is still waited out: test_producer_service)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LTX_QUEUES": f"q-{unique_name}",
           "LTX_REDIS_URL": _url(case, secured, garbage_port, s3_server)}  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "producer", "backfill", str(prompts), "-n", "1"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == ExitCode.UNAVAILABLE, (proc.stdout, proc.stderr)
    assert time.monotonic() - started < 30
    one_line(proc.stderr)


def test_an_invalid_job_id_is_a_usage_error_for_every_command(tmp_path: Path, unique_name: str) -> None:
    """Regression: status/watch/cancel/fetch said "exists but cannot be read: ValueError" (exit 5) where
    `submit --job-id` said exit 2. It is checked before connecting: a dead Redis does not change the answer."""
    env = {"LTX_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "LTX_QUEUES": f"q-{unique_name}"}
    request = tmp_path / "p.json"
    request.write_text('{"prompt": "x"}')
    for command in (["status", "bad id!"], ["watch", "a/b"], ["cancel", "x" * 500], ["fetch", "bad id!"],
                    ["submit", str(request), "--job-id", "bad id!"]):  # fmt: skip
        code, out, err = run(command, env)
        assert (code, out) == (ExitCode.USAGE, ""), (command, err)
        assert "invalid job id" in one_line(err) or "--job-id: job id" in err, err


def test_a_malformed_id_in_a_queue_is_a_note_in_ls_not_an_error(redis_url: str, redis_client, unique_name: str):
    """The id check is for what a user types: an id another client pushed onto the queue by hand must not
    make everyone's `ls` exit 2 (it is listed as unreadable, as before)."""
    queue = f"q-{unique_name}"
    redis_client.rpush(f"rq:queue:{queue}", "bad id!")
    code, out, err = run(["ls", "--json"], {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": queue, "LTX_OPERATOR": "true"})
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["job_id"], r["state"]) for r in rows] == [("bad id!", "unreadable")], rows


def _planted(redis_url: str, queue: str, **meta: Any) -> str:
    """A job enqueued on a queue nobody consumes, its meta then set as a worker would have left it."""
    client = ProducerClient(load_settings(redis_url=redis_url, queues=[queue], client="planter"))
    with client:
        job = client.submit(RenderRequest(prompt="planted"), max_queue_depth=0)
        job.meta.update(meta)
        job.save_meta()
    return job.id


def test_a_refused_fetch_is_a_usage_error_not_an_integrity_one(redis_url: str, unique_name: str, tmp_path: Path):
    """Regression: a fetch refused by the endpoint allow-list exited 7 (integrity), though nothing was read."""
    result = {"url": "http://elsewhere.example:8080/v.mp4?X-Amz-Signature=abc", "sha256": "0" * 64}
    job_id = _planted(redis_url, f"q-{unique_name}", state=JobState.UPLOADED.value, result=result)
    env = {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": f"q-{unique_name}", "LTX_OPERATOR": "true",
           "LTX_S3_ENDPOINT_URL": "http://127.0.0.1:9"}  # fmt: skip
    code, out, err = run(["fetch", job_id, "-o", str(tmp_path / "v.mp4")], env)
    assert (code, out) == (ExitCode.USAGE, ""), err
    assert "refusing to fetch 'http://elsewhere.example:8080/v.mp4'" in one_line(err)
    assert not (tmp_path / "v.mp4").exists()


def test_a_wrong_s3_key_says_so(redis_url: str, s3_server, unique_name: str, tmp_path: Path) -> None:
    """Regression: a 403 from S3 read "Forbidden" with no hint that the key is wrong."""
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{unique_name}/v.mp4", Body=b"video")
    result = {"bucket": s3_server.bucket, "key": f"{unique_name}/v.mp4", "sha256": "0" * 64}
    job_id = _planted(redis_url, f"q-{unique_name}", state=JobState.UPLOADED.value, result=result)
    env = {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": f"q-{unique_name}", "LTX_OPERATOR": "true",
           **s3_server.worker_env(), "LTX_S3_SECRET_ACCESS_KEY": "not-the-key"}  # fmt: skip
    code, out, err = run(["fetch", job_id, "-o", str(tmp_path / "v.mp4")], env)
    assert (code, out) == (ExitCode.UNAVAILABLE, ""), err
    assert "the endpoint refused the S3 key: check LTX_S3_ACCESS_KEY_ID" in one_line(err)
    assert "not-the-key" not in err


def test_requeued_only_after_a_real_requeue(redis_url: str, redis_client, unique_name: str) -> None:
    """Regression: every job showed "re-queued Ns ago": RQ stamps `enqueued_at` just after the producer
    stamps `submitted_at`."""
    queue = f"q-{unique_name}"
    job_id = _planted(redis_url, queue)
    env = {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": queue, "LTX_CLIENT": "planter"}
    code, out, _ = run(["status", job_id, "--json"], env)
    assert code == 0 and json.loads(out)["requeued_at"] is None, out
    code, out, _ = run(["status", job_id], env)
    assert "re-queued" not in out, out
    # an attempt failed and the job was re-queued after it (what RQ's retry does: enqueued_at moves on)
    job = Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)
    job.meta["attempts"] = [{"attempt": 1, "outcome": "retrying", "reason": "runner_error", "at": time.time()}]
    job.save_meta()
    time.sleep(0.01)
    from rq import Queue

    Queue(queue, connection=redis_client, serializer=JSONSerializer).enqueue_job(job)
    code, out, _ = run(["status", job_id, "--json"], env)
    assert code == 0 and json.loads(out)["requeued_at"] is not None, out


def test_messages_render_as_text(redis_url: str, unique_name: str) -> None:
    """Regression: multi-line errors showed literal `\\n`, worker logs showed `<EventType.FLEET: 'fleet'>`."""
    error = {"reason": "runner_error", "message": "RuntimeError: boom\nsecond line of it"}
    job_id = _planted(redis_url, f"q-{unique_name}", state=JobState.FAILED.value, error=error)
    env = {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": f"q-{unique_name}", "LTX_CLIENT": "planter"}
    code, out, _ = run(["status", job_id], env)
    assert code == 0 and "\\n" not in out and "'" not in out, out
    assert "runner_error: RuntimeError: boom" in out and "second line of it" in out and '"planted"' in out
    assert printable("boom\n  at line 3\r\n\tend") == "boom\n  at line 3\n    end"
    assert printable("a\x1b[2J\rb\u202e") == "a\\x1b[2J\\rb\\u202e"  # (what could drive a terminal stays escaped)
    from ltx_contract.states import EventType

    text = event_text({"type": EventType.FLEET, "action": "failed", "reason": "rank_died", "pids": [1, 2]})
    assert text == "failed reason=rank_died pids=[1, 2]"


def test_a_refusal_mid_run_ends_watch_and_backfill_at_once(redis_server_factory, tmp_path: Path, unique_name: str):
    """A user whose rights are revoked mid-run (NOPERM) is no outage to wait out: `watch` (which retries a
    dropped connection for a minute) and `backfill` (five minutes) end at once with one line and exit 6.
    Before: `watch` printed a traceback; `backfill` retried for five minutes."""
    server = redis_server_factory()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "tenant", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    queue = f"q-{unique_name}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LTX_QUEUES": queue, "LTX_MAX_QUEUE_DEPTH": "0",
           "LTX_REDIS_URL": f"redis://127.0.0.1:{server.port}/0", "LTX_REDIS_USERNAME": "tenant",
           "LTX_REDIS_PASSWORD": PASSWORD, "LTX_TENANT_IDS": "false"}  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    cmd = [sys.executable, "-m", "producer"]
    job_id = subprocess.run([*cmd, "submit", str(prompts)], env=env, capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip()  # fmt: skip
    procs = {
        "watch": subprocess.Popen([*cmd, "watch", job_id], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True),
        "backfill": subprocess.Popen([*cmd, "backfill", str(prompts), "-n", "1", "-m", str(tmp_path / "m.jsonl")],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }  # fmt: skip
    try:
        wait_for(lambda: admin.llen(f"rq:queue:{queue}") >= 2, 60, "the backfill's job enqueued", poll=0.2)
        time.sleep(1.0)
        admin.execute_command("ACL", "SETUSER", "tenant", "-@all")
        for name, proc in procs.items():
            _out, err = proc.communicate(timeout=30)
            assert proc.returncode == ExitCode.UNAVAILABLE, (name, proc.returncode, err)
            last = err.strip().splitlines()[-1]  # (backfill's progress lines go to stderr before it)
            assert "Traceback" not in err and last.startswith("producer: ") and "NOPERM" in last, (name, err)
            assert name == "backfill" or one_line(err) == last
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        admin.close()
