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
    # `uploaded` is announced just before the full result replaces RQ's hand-off value (worker/render/pipeline.py):
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
