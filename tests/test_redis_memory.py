"""Redis memory under a hostile client, against real redis-servers started with the
service's memory flags (`devstack.dev_servers.REDIS_MEMORY_ARGS`) and a small `maxmemory`.

- a client that sends `HGETALL`s of a big hash and never reads the replies is disconnected, and the memory
  its output buffer held comes back (it used to stay past `maxmemory`, failing every write);
- no single value can exceed the bulk cap;
- a worker whose Redis refuses every write (OOM) stays up, says so on `/healthz` and `/readyz`, and
  renders again once memory is freed (it used to quit, and crash-loop at registration); when a tenant's
  oversized job hash is what fills Redis, the worker drops it and recovers by itself;
- a submit to a Redis out of memory is one line and exit 6.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from typing import Any

import pytest
import redis

from tests.support.fleet import running_worker
from tests.support.redis_memory import MB, fill_past_maxmemory, used_memory
from tests.support.wait import wait_for
from tests.support.workers import enqueue, http_json, wait_state
from worker.jobs.tenant_memory import RESERVE_BYTES

pytestmark = pytest.mark.timeout(240)


def test_a_client_that_does_not_read_its_replies_is_disconnected(redis_server_factory: Any) -> None:
    server = redis_server_factory()
    client = server.client()
    payload = {f"f{i}": b"y" * (3 * MB) for i in range(10)}  # 30 MB in one hash, every value under the cap
    for field, value in payload.items():
        client.hset("rq:job:alice-big", field, value)
    limit = used_memory(client) + 40 * MB
    client.config_set("maxmemory", limit)
    raw = socket.create_connection(("127.0.0.1", server.port))
    try:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.sendall(b"HGETALL rq:job:alice-big\r\n" * 3)  # ~90 MB of replies, none read

        def dropped() -> bool:
            names = [c for c in client.client_list() if c.get("cmd") == "hgetall"]
            return not names and used_memory(client) < limit

        wait_for(dropped, 20, "the raw client dropped and its output buffer freed")
        client.set("ltx:probe", b"ok")  # writes work again
    finally:
        raw.close()
    # no single value past the bulk cap (4 MB)
    with pytest.raises(redis.RedisError):
        client.hset("rq:job:alice-big", "huge", b"z" * (5 * MB))
    client.close()


def test_a_worker_waits_out_redis_refusing_writes_and_renders_after(tmp_path, redis_server_factory, s3_server):
    server = redis_server_factory()
    with running_worker(tmp_path, server, s3_server) as w:
        port = w.health()["metrics_port"]
        filler = server.client()
        n = fill_past_maxmemory(filler, "filler:")
        refused = wait_for(lambda: (s := http_json(port, "/readyz"))[0] == 503 and not s[1]["redis"]["up"] and s, 30,
                           "/readyz saying Redis refuses the worker", on_fail=w.proc.log_tail)  # fmt: skip
        assert "OutOfMemoryError" in refused[1]["redis"]["reason"]
        time.sleep(6)  # several back-off rounds, maintenance and heartbeats all refused
        assert w.proc.proc.poll() is None, w.proc.log_tail()
        status, info = http_json(port, "/healthz")
        assert status == 200 and info["live"] and not info["redis"]["up"], info
        log = w.proc.log_tail(200_000)
        assert "unhandled exception" not in log and log.count("Redis refuses the worker") == 1, log[-4000:]
        filler.delete(*[f"filler:{i}" for i in range(n)])
        job = enqueue(w.conn, w.queue, {"prompt": "after the outage", "width": 64, "height": 64, "num_frames": 9})
        assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "uploaded", job.get_meta()
        status, info = http_json(port, "/readyz")
        assert status == 200 and info["redis"]["up"] and info["redis"]["outages"] == 1, info
        # A tenant fills Redis through her own job hash (never queued): the worker, refused for memory,
        # drops hashes no job of this service can fill, and comes back without an operator.
        filler.config_set("maxmemory", 0)
        bloat = "rq:job:alice-bloat"
        for i in range(4):
            filler.hset(bloat, f"pad{i}", b"y" * (3 * MB))
        time.sleep(2.5)  # (Redis shrinks an idle client's query buffer after 2 s: measured after it, not before)
        filler.config_set("maxmemory", used_memory(filler) - 4 * MB - 2 * RESERVE_BYTES)  # (see fill_past_maxmemory)
        wait_for(lambda: http_json(port, "/readyz")[0] == 503, 30, "Redis refusing the worker again")
        wait_for(lambda: http_json(port, "/readyz")[0] == 200, 60, "recovered by itself", on_fail=w.proc.log_tail)
        assert filler.hget(bloat, "pad0") is None and filler.hget(bloat, "status") == b"failed"
        job = enqueue(w.conn, w.queue, {"prompt": "after the sweep", "width": 64, "height": 64, "num_frames": 9})
        assert wait_state(job, {"uploaded", "failed"}, 90, w.proc) == "uploaded", job.get_meta()
        filler.close()


def test_a_submit_to_a_redis_out_of_memory_is_one_line_and_exit_6(redis_server_factory, tmp_path) -> None:
    from click.testing import CliRunner

    from producer.cli import cli
    from producer.exit_codes import ExitCode

    server = redis_server_factory()
    filler = server.client()
    fill_past_maxmemory(filler, "filler:")
    request = tmp_path / "fox.json"
    request.write_text(json.dumps({"prompt": "a fox", "width": 64, "height": 64, "num_frames": 9}))
    env = {"LTX_REDIS_URL": server.url, "LTX_QUEUES": "q-oom", "LTX_CLIENT": "bob"}
    result = CliRunner().invoke(cli, ["submit", str(request)], env=env, catch_exceptions=False)
    assert result.exit_code == ExitCode.UNAVAILABLE, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "out of memory" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    filler.close()


def test_event_writes_wait_out_a_short_out_of_memory_spell(redis_server_factory) -> None:
    """A render's events (`ltx_contract.event_stream`) retried only connection errors: one OOM failed the job."""
    import threading

    from ltx_contract.redis_retry import with_redis_retry

    server = redis_server_factory()
    client = server.client()
    n = fill_past_maxmemory(client, "filler:")
    threading.Timer(1.0, lambda: server.client().delete(*[f"filler:{i}" for i in range(n)])).start()
    t0 = time.monotonic()
    assert with_redis_retry(lambda: client.xadd("ltx:job:x:events", {"type": "progress"}), outage_s=20)
    assert 0.9 < time.monotonic() - t0 < 15
    with pytest.raises(redis.ResponseError):  # anything else still raises at once
        with_redis_retry(lambda: client.execute_command("HSET", "k"), outage_s=20)
    client.close()


def test_a_sigterm_while_the_worker_waits_to_register_is_a_warm_stop(tmp_path, redis_server_factory, s3_server):
    """RQ installs its signal handlers only once its loop starts, after registering the worker. A SIGTERM in
    between took the default action (exit -15, found when a test's teardown met a worker still
    registering). A Redis over `maxmemory` holds the worker in exactly that window (registration waits the
    outage out), so the signal lands there every time: the worker must stop warm, exit 0, and leave no rank."""
    from tests.support.workers import WorkerProcess, pid_alive, worker_env

    server = redis_server_factory()
    filler = server.client()
    fill_past_maxmemory(filler, "filler:")
    env = worker_env(server.url, s3_server, queue="q-window", name="window", spool=tmp_path / "spool")
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp_path / "window.log").start()
    try:
        wait_for(lambda: "Redis refuses the worker" in proc.log_tail(), 90, "registration waiting out the outage",
                 on_fail=proc.log_tail)  # fmt: skip
        ranks = [int(p) for p in re.findall(r"pids=\[(\d+)", proc.log_tail(200_000))]
        proc.signal(signal.SIGTERM)
        # (the outage back-off sleeps at most 10 s between attempts; the fleet's shutdown takes a few more)
        assert proc.wait(60) == 0, proc.log_tail()
        assert "Traceback" not in proc.log_tail(200_000), proc.log_tail()
        assert ranks and not any(pid_alive(p) for p in ranks), ranks
    finally:
        proc.stop()
        filler.close()


def test_a_stop_signal_during_a_lost_connection_is_a_stop_not_an_outage() -> None:
    """Regression (test_redis_restart's teardown): RQ's dequeue sleeps after a lost connection; a SIGTERM
    there raises StopRequested while the ConnectionError is being handled. The outage check walked the
    exception's context, took the stop for an outage and waited it out: the warm stop was lost and the
    worker ran until it was killed. Only the refusal itself is an outage."""
    from rq.exceptions import StopRequested

    from ltx_contract.redis_retry import outage_reason

    lost = redis.exceptions.ConnectionError("Connection closed by server.")
    try:
        try:
            raise lost
        except redis.exceptions.ConnectionError:
            raise StopRequested() from None
    except StopRequested as stop:
        stop.__context__ = lost  # (what a handler raising inside RQ's `except ConnectionError` leaves)
        assert outage_reason(stop) is None
    assert outage_reason(lost) is not None
