"""Two fleets side by side under one `ltx-worker --group cpu:1 --group cpu:1` supervisor: concurrent
renders, and a worker process SIGKILLed mid-job (restarted by the supervisor; the job is re-run once by
RQ's abandoned-job cleanup, never twice, never lost). Real Redis, real S3, real CPU fleets."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from rq.job import JobStatus

from producer.client import ProducerClient
from producer.settings import load_settings
from tests.support.runners import read_records
from tests.support.wait import wait_for
from tests.support.workers import (
    LaunchedWorker,
    events,
    launch_worker,
    pid_alive,
    wait_ready,
    wait_state,
    worker_health,
)

pytestmark = pytest.mark.timeout(240)


class Pair(LaunchedWorker):
    def ready(self, timeout: float = 120) -> list[dict[str, Any]]:
        return wait_ready(self.conn, self.name, 2, timeout, self.proc)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("pair")
    w = launch_worker(tmp, redis_server, s3_server, ["--group", "cpu:1", "--group", "cpu:1"], prefix="p",
                      log_name="supervisor.log")  # fmt: skip
    proc, conn, name = w.proc, w.conn, w.name
    p = Pair(proc, conn, w.queue, name)
    p.ready()
    try:
        yield p
    finally:
        workers = [h["pid"] for h in worker_health(conn, name)]
        ranks = [pid for h in worker_health(conn, name) for pid in h["fleet"]["pids"]]
        rc = proc.stop(90)
        assert rc == 0, proc.log_tail()
        wait_for(lambda: not any(pid_alive(x) for x in workers + ranks), 20, "no process left")
        conn.close()


def test_two_groups_render_concurrently(pair):
    pair.ready()
    jobs = [pair.submit("t step_s=0.25", steps=8, seed=i) for i in range(2)]
    for job in jobs:
        assert wait_state(job, {"uploaded", "failed"}, 90, pair.proc) == "uploaded", job.get_meta(refresh=True)
    spans = []
    for job in jobs:
        evts = {e.get("state"): e["ts"] for e in events(pair.conn, job.id) if e["type"] == "state"}
        spans.append((evts["rendering"], evts["rendered"]))
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"render intervals do not overlap: {spans}"
    # `uploaded` is announced just before the full result replaces RQ's hand-off value (worker/stages/upload.py):
    # wait for the replacement rather than race it.
    results = [wait_for(lambda j=job: "fleet" in (r := j.latest_result().return_value) and r, 10, "the full result")
               for job in jobs]  # fmt: skip
    workers = {r["fleet"]["worker"] for r in results}
    assert len(workers) == 2


def test_worker_sigkilled_mid_job_is_rerun_once_not_lost(pair, tmp_path):
    before = {h["pid"]: h for h in pair.ready()}
    record = tmp_path / "exec.jsonl"
    job = pair.submit(f"t step_s=0.25 record={record}", steps=16)
    wait_for(lambda: (job.get_meta(refresh=True).get("step") or 0) >= 2, 60, "progress", on_fail=pair.proc.log_tail)
    victim_name = job.get_meta(refresh=True)["worker"]
    victim = next(h for h in before.values() if h["worker"] == victim_name)
    os.kill(victim["pid"], signal.SIGKILL)
    # the killed worker's ranks notice their parent died and exit (no orphaned fleet)
    wait_for(lambda: not any(pid_alive(p) for p in victim["fleet"]["pids"]), 30, "orphaned ranks to exit")
    # RQ's cleanup (the surviving worker's maintenance, every 2 s) finds it abandoned after the 6 s
    # heartbeat deadline and re-queues it once (retry_worker_lost=1); a worker runs it to the end.
    assert wait_state(job, {"uploaded", "failed"}, 120, pair.proc) == "uploaded", job.get_meta(refresh=True)
    recs = read_records(record)
    starts = [r for r in recs if r["event"] == "start"]
    ends = [r for r in recs if r["event"] == "end"]
    assert len(starts) == 2 and len(ends) == 1, recs
    assert ends[0]["t"] > starts[1]["t"] > starts[0]["t"]  # the second run began after the first died
    assert starts[0]["pid"] in victim["fleet"]["pids"]
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    results = job.results()
    assert [r.type.name for r in results] == ["SUCCESSFUL"], results
    meta = job.get_meta(refresh=True)
    assert meta["attempt"] == 2 and meta["retries"] == {"worker_lost": 1}
    # the current error is null once the job succeeded; the attempt history keeps the loss
    assert meta["error"] is None, meta
    assert [(a["attempt"], a["reason"], a["worker"]) for a in meta["attempts"]] == [(1, "worker_lost", victim_name)]
    # and what `producer status` shows: first submission <= latest start <= the end (the upload's)
    info = ProducerClient(load_settings(queues=[pair.queue]), connection=pair.conn).status(job.id)
    assert info.error is None and info.enqueued_at <= info.started_at <= info.ended_at, info
    uploaded_ts = next(e["ts"] for e in events(pair.conn, job.id) if e.get("state") == "uploaded")
    assert info.ended_at.timestamp() >= uploaded_ts - 0.01 and info.requeued_at is not None
    kinds = [e.get("state") for e in events(pair.conn, job.id) if e["type"] == "state"]
    assert kinds.count("started") == 2 and "retrying" in kinds and kinds[-1] == "uploaded"
    # the supervisor restarted the killed worker: two live fleets again, one of them new
    after = pair.ready()
    assert victim["pid"] not in {h["pid"] for h in after}


@pytest.mark.timeout(420)  # (three cold worker starts on a loaded CI machine: about a minute each)
def test_a_worker_that_never_gets_ready_backs_off_and_the_supervisor_says_so(tmp_path, redis_server, s3_server):
    """A real `ltx-worker` supervisor over a worker whose fleet can never be built (its runner's setup raises):
    each exit before readiness doubles the wait before the restart, however long the worker ran (a 6-minute
    warm-up that failed was restarted after 1 s, for ever), and from the third such exit in a row the
    supervisor logs a critical line naming the group and the exit code, sets `ltx_supervisor_crash_loop` and
    answers `/readyz` 503 with the reason. Bounded: a 0.3 s base, capped at 0.6 s, three exits."""
    import json
    import re
    import urllib.error
    import urllib.request

    from devstack.ports import free_port

    port = free_port()
    w = launch_worker(tmp_path, redis_server, s3_server, ["--group", "cpu:1"], prefix="nr", log_name="sup.log",
                      runner="broken", max_rebuild_failures=1, restart_backoff_s=0.3, restart_backoff_max_s=0.6,
                      restart_alarm_after=3, supervisor_port=port)  # fmt: skip

    def readyz() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except OSError:
            return 0, {}

    def supervisor_lines() -> list[dict[str, Any]]:
        out = []
        for line in w.proc.log_tail(2_000_000).splitlines():
            if line.startswith("{") and '"logger": "worker.runtime.supervisor"' in line:
                out.append(json.loads(line))
        return out

    try:
        wait_for(lambda: any(x["level"] == "CRITICAL" for x in supervisor_lines()), 360, "a critical crash-loop line",
                 on_fail=w.proc.log_tail)  # fmt: skip
        status, body = readyz()
        assert status == 503 and body["ready"] is False, (status, body)
        (group,) = body["groups"]
        assert group["crash_loop"] is True and group["last_exit_code"] == 3 and group["never_ready_exits"] >= 3
        assert "exited" in body["reason"] and "before it was ever ready (last exit code 3)" in body["reason"], body
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
        assert 'ltx_supervisor_crash_loop{group="cpu:1"} 1.0' in metrics, metrics
        lines = supervisor_lines()
        delays = [float(m.group(1)) for x in lines if (m := re.search(r"restarting in ([\d.]+)s", x["msg"]))]
        assert delays[:3] == [0.3, 0.6, 0.6], delays  # doubling per never-ready exit, capped
        critical = [x["msg"] for x in lines if x["level"] == "CRITICAL"]
        assert all("group cpu:1" in m and "before it was ever ready (last exit code 3" in m for m in critical)
        assert "exited 3 times in a row" in critical[0], critical
        # the waits really happened: each restart came at least its back-off after the exit before it
        exits = [x["ts"] for x in lines if "restarting in" in x["msg"]]
        starts = [x["ts"] for x in lines if x["msg"].startswith("started worker")]
        for exited, delay, started in zip(exits, delays, starts[1:], strict=False):
            assert started - exited >= delay - 0.05, (exits, starts, delays)
    finally:
        rc = w.proc.stop(60)
        w.conn.close()
    assert rc == 0, w.proc.log_tail()


def test_the_supervisors_readyz_follows_its_workers(tmp_path, redis_server_factory, s3_server):
    """The supervisor's `/readyz` said 200 while its worker's said 503 (here: Redis refusing the
    worker for memory), because the worker told the supervisor only once, when it first got warm. Now each
    change of the worker's readiness reaches the supervisor: 503 naming the group and the worker's reason,
    200 again once the worker is. Real Redis, real S3, a real supervisor over one CPU fleet."""
    from devstack.ports import free_port
    from tests.support.redis_memory import fill_past_maxmemory
    from tests.support.workers import http_json

    server = redis_server_factory()
    port = free_port()
    w = launch_worker(tmp_path, server, s3_server, ["--group", "cpu:1"], prefix="rz", supervisor_port=port)
    # The worker re-checks its readiness every 0.25 s and the supervisor reads its pipe every 0.1 s: the
    # supervisor follows within a second; 10 s leaves room for a loaded 2-core machine.
    follows_s = 10

    def answers(probe_port: int, status: int, what: str, timeout: float = follows_s) -> dict[str, Any]:
        found = wait_for(
            lambda: (s := http_json(probe_port, "/readyz"))[0] == status and s, timeout, what, on_fail=w.proc.log_tail
        )
        return found[1]

    try:
        (info,) = wait_ready(w.conn, w.name, 1, 120, w.proc)
        answers(port, 200, "the supervisor ready")
        filler = server.client()
        n = fill_past_maxmemory(filler, "filler:")
        answers(info["metrics_port"], 503, "the worker not ready", timeout=30)
        body = answers(port, 503, "the supervisor not ready either")
        assert body["ready"] is False and body["groups"][0]["ready"] is False, body
        assert "group cpu:1: the worker is not ready: Redis refuses the worker" in body["reason"], body
        filler.delete(*[f"filler:{i}" for i in range(n)])
        answers(info["metrics_port"], 200, "the worker ready again", timeout=60)
        body = answers(port, 200, "the supervisor ready again")
        assert body["ready"] is True and body["reason"] is None, body
        filler.close()
    finally:
        rc = w.proc.stop(60)
        w.conn.close()
    assert rc == 0, w.proc.log_tail()
