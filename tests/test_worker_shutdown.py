"""Stopping workers: warm (finish the job), cold (abort and re-queue it), unrecoverable fleets (exit 3),
invalid settings (exit 2). Real processes and signals; each test owns its worker (world 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from rq.job import JobStatus

from tests.support.runners import read_records
from tests.support.wait import wait_for
from tests.support.workers import (
    ROOT,
    SMALL_REQUEST,
    WorkerProcess,
    enqueue,
    events,
    launch_worker,
    pid_alive,
    wait_ready,
    wait_state,
    worker_env,
)

pytestmark = pytest.mark.timeout(240)


def _worker(tmp: Path, redis_server: Any, s3_server: Any, args: list[str], **extra: Any) -> tuple[Any, ...]:
    w = launch_worker(tmp, redis_server, s3_server, args, prefix="s", **extra)
    return w.proc, w.conn, w.queue, w.name


def _submit(conn: Any, queue: str, prompt: str, **request: Any) -> Any:
    return enqueue(conn, queue, {"prompt": prompt, **SMALL_REQUEST, **request})


def _progress(job: Any, proc: WorkerProcess, at_least: int = 2) -> None:
    wait_for(lambda: (job.get_meta(refresh=True).get("step") or 0) >= at_least, 60, "progress",
             on_fail=proc.log_tail)  # fmt: skip


def test_warm_stop_via_supervisor_finishes_running_job(tmp_path, redis_server, s3_server):
    proc, conn, queue, name = _worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1"])
    (info,) = wait_ready(conn, name, 1, 120, proc)
    job = _submit(conn, queue, "t step_s=0.2", steps=15)
    waiting = _submit(conn, queue, "t")  # must stay queued: a warm stop takes no new job
    _progress(job, proc)
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_tail()
    assert job.get_meta(refresh=True)["state"] == "uploaded"
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert waiting.get_status(refresh=True) == JobStatus.QUEUED
    wait_for(lambda: not any(pid_alive(p) for p in [info["pid"], *info["fleet"]["pids"]]), 20, "all gone")


def test_cold_stop_aborts_job_requeues_it_and_a_new_worker_finishes_it(tmp_path, redis_server, s3_server):
    record = tmp_path / "exec.jsonl"
    proc, conn, queue, name = _worker(tmp_path, redis_server, s3_server, ["one", "--group", "cpu:1"])
    (info,) = wait_ready(conn, name, 1, 120, proc)
    job = _submit(conn, queue, f"t step_s=0.3 record={record}", steps=40)
    _progress(job, proc)
    proc.signal(signal.SIGTERM)
    time.sleep(1.3)  # RQ ignores a second signal within 1 s (the same Ctrl+C seen twice)
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_tail()
    wait_for(lambda: not any(pid_alive(p) for p in info["fleet"]["pids"]), 20, "fleet killed")
    meta = job.get_meta(refresh=True)
    assert meta["state"] == "retrying" and meta["error"]["reason"] == "worker_shutdown", meta
    assert job.get_status(refresh=True) == JobStatus.QUEUED  # re-queued explicitly, not lost
    assert [r["event"] for r in read_records(record)] == ["start"]
    # a new worker picks it up and finishes it
    proc2, _, _, _ = _worker(tmp_path, redis_server, s3_server, ["one", "--group", "cpu:1"],
                                 queues=queue, worker_name=name + "b")  # fmt: skip
    try:
        assert wait_state(job, {"uploaded", "failed"}, 120, proc2) == "uploaded"
        assert job.get_meta(refresh=True)["attempt"] == 2
        assert [r["event"] for r in read_records(record)] == ["start", "start", "end"]
    finally:
        assert proc2.stop(60) == 0, proc2.log_tail()


def test_repeated_rebuild_failures_exit_nonzero(tmp_path, redis_server, s3_server):
    marker = tmp_path / "break-setup"
    proc, conn, queue, name = _worker(
        tmp_path, redis_server, s3_server, ["one", "--group", "cpu:1"],
        runner_setup=f'{{"fail_if_exists": "{marker}"}}', max_rebuild_failures=2, rebuild_backoff_s=0,
    )  # fmt: skip
    (info,) = wait_ready(conn, name, 1, 120, proc)
    marker.touch()  # from now on every (re)build fails in setup()
    job = _submit(conn, queue, "t exit_rank=0 exit_step=1")
    assert proc.wait(120) == 3, proc.log_tail()
    meta = job.get_meta(refresh=True)
    # retry_fleet_failure=1 (default): the job went back to the queue for a healthy worker, not lost
    assert meta["state"] == "retrying" and meta["error"]["reason"] == "fleet_failure", meta
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    assert "failed to start 2 times in a row" in proc.log_tail()
    assert not any(pid_alive(p) for p in info["fleet"]["pids"])
    fleet_events = [e for e in events(conn, job.id) if e["type"] == "fleet"]
    assert fleet_events and fleet_events[0]["rank"] == 0 and fleet_events[0]["exitcode"] == 9


def test_invalid_settings_exit_2_naming_the_variable(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "LTX_RENDER_TIMEOUT": "soon", "LTX_GROUPS": "0,1;1,2"}
    cmd = [sys.executable, "-m", "worker", "settings"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False, text=True, timeout=60)
    assert res.returncode == 2
    assert "LTX_RENDER_TIMEOUT" in res.stderr and "LTX_GROUPS" in res.stderr and "share a GPU" in res.stderr
    cmd = [sys.executable, "-m", "worker", "one", "--group", "cpu:0"]
    res = subprocess.run(
        cmd, env={"PATH": "/usr/bin"}, cwd=ROOT, capture_output=True, check=False, text=True, timeout=60
    )
    assert res.returncode == 2 and "--group" in res.stderr


def test_a_redis_url_naming_a_port_that_is_not_redis_exits_2_at_once(tmp_path, redis_server, s3_server):
    """Regression: pointed at the S3 port, the worker printed a traceback ending in redis-py's
    "Protocol Error: b'HTTP/1.1 400 Bad Request'", exited 1, and the supervisor restarted it without end.
    Now it is a configuration error: one line naming LTX_REDIS_URL, exit 2, not restarted."""
    env = worker_env(f"redis://127.0.0.1:{s3_server.s3_port}/0", s3_server, queue="q-notredis", name="notredis",
                     spool=tmp_path / "spool", log_format="text")  # fmt: skip
    cmd = [sys.executable, "-m", "worker", "--group", "cpu:1"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False, text=True, timeout=120)
    output = res.stdout + res.stderr
    assert res.returncode == 2, output
    assert "does not speak the Redis protocol" in output and "LTX_REDIS_URL" in output, output
    assert "Traceback" not in output and output.count("does not speak the Redis protocol") == 1, output


def test_workers_stop_themselves_when_the_supervisor_is_killed(tmp_path, redis_server, s3_server):
    proc, conn, _, name = _worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1"])
    (info,) = wait_ready(conn, name, 1, 120, proc)
    proc.signal(signal.SIGKILL)
    proc.wait(10)
    everything = [info["pid"], *info["fleet"]["pids"]]
    wait_for(lambda: not any(pid_alive(p) for p in everything), 60, "orphaned worker and ranks to exit")


def test_sigterm_during_fleet_start_stops_cleanly(tmp_path, redis_server, s3_server):
    proc, _, _, _ = _worker(tmp_path, redis_server, s3_server, ["one", "--group", "cpu:2"])
    wait_for(lambda: "fleet cpu:2: starting" in proc.log_tail(), 60, "fleet start begun", on_fail=proc.log_tail)
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_tail()
    assert "stopped by SIGTERM during startup" in proc.log_tail()


def test_ctrl_c_at_the_supervisor_is_logged_as_sigint_by_its_workers(tmp_path, redis_server, s3_server):
    """Ctrl+C (SIGINT) at `ltx-worker` was forwarded to its workers as SIGTERM, and each logged "stopped by
    SIGTERM": the log named a signal nobody sent. The supervisor forwards the signal it got."""
    proc, _, _, _ = _worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1"], runner_setup='{"setup_s": 60}')
    wait_for(lambda: "fleet cpu:1: starting" in proc.log_tail(), 60, "fleet start begun", on_fail=proc.log_tail)
    proc.signal(signal.SIGINT)
    assert proc.wait(60) == 0, proc.log_tail()
    log = proc.log_tail(200_000)
    assert "supervisor got SIGINT" in log and "stopped by SIGINT during startup" in log, log[-3000:]
    assert "SIGTERM" not in log, log[-3000:]


# ==== errors that can never fix themselves, and those that do ======================================


def test_bad_s3_credentials_stop_the_supervisor_at_once_with_code_2(tmp_path, redis_server, s3_server):
    """Each worker exits 2; the supervisor used to restart them 5 times and exit 4 after ~30 s."""
    proc, conn, _, _ = _worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1", "--group", "cpu:1"],
                               s3_secret_access_key="wrong-secret")  # fmt: skip
    conn.close()
    assert proc.wait(60) == 2, proc.log_tail()
    log = proc.log_tail(20000)
    assert "a configuration error" in log and "restarting in" not in log, log


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_group_on_a_machine_without_cuda_exits_2_with_one_line(tmp_path, redis_server, s3_server):
    """Its ranks used to die with `module 'torch._C' has no attribute '_cuda_setDevice'`, again and again."""
    proc, conn, _, _ = _worker(tmp_path, redis_server, s3_server, ["one", "--group", "0"])
    conn.close()
    assert proc.wait(60) == 2, proc.log_tail()
    log = proc.log_tail()
    assert "group '0' needs cuda:0, but torch" in log and "use --group cpu:N" in log, log
    assert "_cuda_setDevice" not in log and "Traceback" not in log


def test_worker_started_before_redis_waits_for_it_saying_so(tmp_path, s3_server):
    """Redis not up yet is transient: wait with back-off and say so (it used to die with a raw traceback
    from RQ's client_setname, be restarted 5 times, and make the supervisor exit 4)."""
    from devstack.dev_servers import RedisServer, free_port

    port = free_port()
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"w{uuid.uuid4().hex[:6]}"
    env = worker_env(f"redis://127.0.0.1:{port}/0", s3_server, queue=queue, name=name, spool=tmp_path / "spool")
    proc = WorkerProcess(["--group", "cpu:1"], env, tmp_path / "supervisor.log").start()
    redis = RedisServer(port=port)
    try:
        wait_for(lambda: proc.log_tail().count("is not reachable") >= 2, 60, "the worker saying it waits",
                 on_fail=proc.log_tail)  # fmt: skip
        assert proc.proc is not None and proc.proc.poll() is None
        redis.start()
        conn = redis.client()
        wait_ready(conn, name, 1, 120, proc)
        conn.close()
        log = proc.log_tail(20000)
        assert "Traceback" not in log and "restarting in" not in log, log
    finally:
        assert proc.stop(90) == 0, proc.log_tail()
        redis.cleanup()


def test_a_job_cancelled_after_a_retried_fleet_failure_shows_the_cancel_not_the_old_error(
    tmp_path, redis_server, s3_server
):
    """Regression: a rank killed mid-job (the job retried), then a cancel during attempt 2: the watch ended
    `job cancelled: fleet_failure: ...` and `status --json` kept `error.reason: fleet_failure, retryable:
    true` on a cancelled job. The cancel clears the summary's error; the failed attempt stays in `attempts`."""
    from ltx_contract.control import cancel_job

    proc, conn, queue, name = _worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1"], retry_fleet_failure=1)
    try:
        (info,) = wait_ready(conn, name, 1, 120, proc)
        job = _submit(conn, queue, "t step_s=0.2", steps=100)
        _progress(job, proc)
        os.kill(info["fleet"]["pids"][0], signal.SIGKILL)  # the rank dies mid-job

        def second_attempt_rendering() -> bool:
            meta = job.get_meta(refresh=True)
            return meta.get("attempt") == 2 and meta.get("state") == "rendering" and (meta.get("step") or 0) >= 1

        wait_for(second_attempt_rendering, 90, "attempt 2 progress", on_fail=proc.log_tail)
        assert job.get_meta(refresh=True)["error"]["reason"] == "fleet_failure"  # (attempt 1's, while retrying)
        assert cancel_job(conn, job.id) == "stop_requested"
        assert wait_state(job, {"cancelled", "failed", "uploaded"}, 30, proc) == "cancelled"
        meta = job.get_meta(refresh=True)
        assert meta.get("error") is None, meta
        assert [(a["attempt"], a["reason"]) for a in meta["attempts"]] == [(1, "fleet_failure")], meta["attempts"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
        env.update(LTX_REDIS_URL=redis_server.url, LTX_QUEUES=queue)
        cmd = [sys.executable, "-m", "producer"]
        status = subprocess.run([*cmd, "status", job.id, "--json"], env=env, capture_output=True, text=True, timeout=60,
                                check=True)  # fmt: skip
        data = json.loads(status.stdout)
        assert data["state"] == "cancelled" and data.get("error") is None, data
        watch = subprocess.run([*cmd, "watch", job.id], env=env, capture_output=True, text=True, timeout=60,
                               check=False)  # fmt: skip
        # (the history above it still shows attempt 1's `retrying ... fleet_failure`; the end line is the cancel)
        assert watch.returncode == 4 and watch.stdout.strip().splitlines()[-1] == "job cancelled", watch.stdout
    finally:
        assert proc.stop(90) == 0, proc.log_tail()
