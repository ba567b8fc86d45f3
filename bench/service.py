"""Service overheads around the fleet: RQ, Redis Streams, S3. Real Redis, real SeaweedFS, a real worker.

Prints one JSON line per measurement and a final summary line. In the same run:
- enqueue → start latency on an idle worker (client clock before `enqueue` → the worker's `started`
  event; same machine, same clock), p50/p99, one job at a time;
- runner yield → stream latency, p50/p99: the NoopRunner stamps `t_yield` on the driver rank; measured
  to the stream entry's id (Redis server time at XADD, 1 ms resolution) and to a client's XREAD BLOCK
  arrival (what a watcher sees);
- jobs per second per fleet with the no-op runner (4 KiB output, uploaded to S3): a backlog of jobs
  drained by one worker, first start → last upload confirmed;
- upload GB/s of the worker's storage path (`S3Storage.put`: head, managed multipart upload with
  sha256 metadata, read-back confirmation) vs plain boto3 `upload_file` of the same file to the same
  server, interleaved, same run. The sha256 of the file is computed when the render is committed to the
  spool, before the upload; its time is reported separately (`sha256_gbps`).

Targets: enqueue→start p50 < 50 ms, yield→stream p50 < 10 ms, upload >= 0.9x plain boto3.

Usage: python -m bench.service [--group cpu:1] [--latency-jobs 30] [--backlog 100]
                                         [--steps 200] [--upload-mib 256] [--upload-reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import emit, pct
from devstack.dev_servers import RedisServer, S3Server
from ltx_contract.keys import EVENT_FIELD_DATA, RENDER_FUNC, events_key

ROOT = Path(__file__).resolve().parent.parent  #: the checkout: the worker subprocesses run from it


def stats_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(pct(ms, 50), 3), "p99_ms": round(pct(ms, 99), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "n": len(ms)}  # fmt: skip


# ==== a worker process =================================================================================


class Worker:
    def __init__(self, redis: RedisServer, s3: S3Server, group: str, tmp: Path, **settings: Any) -> None:
        self.queue = f"bench-{uuid.uuid4().hex[:6]}"
        self.name = f"bench{uuid.uuid4().hex[:6]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
        env.update(
            LTX_REDIS_URL=redis.url, LTX_QUEUES=self.queue, LTX_WORKER_NAME=self.name, LTX_RUNNER="noop",
            LTX_SPOOL_DIR=str(tmp / "spool"), LTX_S3_ENDPOINT_URL=s3.url, LTX_S3_BUCKET=s3.bucket,
            LTX_S3_ACCESS_KEY_ID=s3.access_key, LTX_S3_SECRET_ACCESS_KEY=s3.secret_key, LTX_METRICS_PORT="0",
            LTX_METRICS_HOST="127.0.0.1", LTX_LOG_LEVEL="WARNING",
        )  # fmt: skip
        env.update({f"LTX_{k.upper()}": str(v) for k, v in settings.items()})
        self.log = (tmp / f"{self.name}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", "one", "--group", group], env=env, cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        self.conn = redis.client()
        from rq import Queue
        from rq.serializers import JSONSerializer

        self.q = Queue(self.queue, connection=self.conn, serializer=JSONSerializer)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log.name}")
            for key in self.conn.scan_iter(match=f"ltx:worker:{self.name}.*:health"):
                raw = self.conn.get(key)
                if raw and json.loads(raw)["fleet"]["alive"]:
                    return
            time.sleep(0.05)
        raise RuntimeError("worker not ready in 180 s")

    def enqueue(self, **request: Any) -> Any:
        return self.q.enqueue(RENDER_FUNC, {"prompt": "bench", "width": 64, "height": 64, "num_frames": 9, **request},
                              job_timeout=600, result_ttl=600, failure_ttl=600)  # fmt: skip

    def state_events(self, job_id: str) -> list[dict[str, Any]]:
        out = []
        for _, fields in self.conn.xrange(events_key(job_id)):
            out.append(json.loads(fields[EVENT_FIELD_DATA.encode()]))
        return out

    def wait_terminal(self, job: Any, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = job.get_meta(refresh=True).get("state")
            if state in ("uploaded", "failed", "cancelled"):
                return state
            time.sleep(0.002)
        raise RuntimeError(f"job {job.id} not done in {timeout}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ==== measurements ======================================================================================


def bench_enqueue_to_start(w: Worker, jobs: int) -> dict[str, Any]:
    lat = []
    for _ in range(jobs):
        time.sleep(0.05)  # the worker is idle, blocked in BLMOVE
        t0 = time.time()
        job = w.enqueue(steps=1)
        state = w.wait_terminal(job)
        assert state == "uploaded", state
        started = next(e for e in w.state_events(job.id) if e.get("state") == "started")
        lat.append(started["ts"] - t0)
    rec = {"bench": "enqueue_to_start", **stats_ms(lat)}
    emit(rec)
    return rec


def bench_yield_to_stream(w: Worker, steps: int) -> dict[str, Any]:
    job = w.enqueue(steps=steps)
    key = events_key(job.id)
    reader_lat: list[float] = []
    last = "0-0"
    done = False
    while not done:
        resp = w.conn.xread({key: last}, count=100, block=1000)
        now = time.time()
        for _, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id
                data = json.loads(fields[EVENT_FIELD_DATA.encode()])
                if data["type"] == "progress" and "t_yield" in data and data["step"] > 1:
                    reader_lat.append(now - data["t_yield"])
                if data.get("state") in ("uploaded", "failed"):
                    done = True
    stream_lat = []
    for entry_id, fields in w.conn.xrange(key):
        data = json.loads(fields[EVENT_FIELD_DATA.encode()])
        if data["type"] == "progress" and "t_yield" in data and data["step"] > 1:
            ms = int(entry_id.decode().split("-")[0])
            stream_lat.append(max(0.0, ms / 1000 - data["t_yield"] + 0.0005))  # mid-ms of the id's resolution
    rec = {"bench": "yield_to_stream", "steps": steps, **stats_ms(stream_lat),
           "reader": stats_ms(reader_lat)}  # fmt: skip
    emit(rec)
    return rec


def bench_jobs_per_second(w: Worker, backlog: int, group: str) -> dict[str, Any]:
    jobs = [w.enqueue(steps=1) for _ in range(backlog)]
    for job in jobs:
        assert w.wait_terminal(job, 600) == "uploaded"
    starts, ends = [], []
    for job in jobs:
        evts = w.state_events(job.id)
        starts.append(next(e["ts"] for e in evts if e.get("state") == "started"))
        ends.append(next(e["ts"] for e in evts if e.get("state") == "uploaded"))
    span = max(ends) - min(starts)
    per_job = [e - s for s, e in zip(starts, ends, strict=True)]
    rec = {"bench": "jobs_per_second", "group": group, "jobs": backlog, "jobs_per_s": round(backlog / span, 2),
           "job_wall": stats_ms(per_job)}  # fmt: skip
    emit(rec)
    return rec


def bench_upload(s3: S3Server, mib: int, reps: int, tmp: Path) -> dict[str, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from worker.settings import WorkerSettings
    from worker.uploads.spool import Spool, sha256_file
    from worker.uploads.storage import S3Storage

    settings = WorkerSettings(
        s3_endpoint_url=s3.url, s3_bucket=s3.bucket, s3_access_key_id=s3.access_key,
        s3_secret_access_key=s3.secret_key, s3_prefix="bench/",
    )  # fmt: skip
    storage = S3Storage(settings)
    spool = Spool(tmp / "upload-spool")
    path = spool.prepare("bench-upload", "video.mp4")
    with path.open("wb") as fh:
        for _ in range(mib):
            fh.write(os.urandom(1 << 20))
    t0 = time.perf_counter()
    sha256_file(path)
    sha_s = time.perf_counter() - t0
    entry = spool.commit("bench-upload", file_name="video.mp4", key="", content_type="video/mp4")
    plain = boto3.client(
        "s3", endpoint_url=s3.url, region_name="us-east-1", aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                      response_checksum_validation="when_required"),
    )  # fmt: skip
    from dataclasses import replace

    def run_ours() -> float:
        e = replace(entry, key=f"bench/ours-{uuid.uuid4().hex[:8]}.mp4")  # fresh key: no reuse skip
        t0 = time.perf_counter()
        stored = storage.put(e)
        assert not stored.reused and stored.sha256 == entry.sha256
        return time.perf_counter() - t0

    def run_plain() -> float:
        t0 = time.perf_counter()
        plain.upload_file(str(path), s3.bucket, f"bench/plain-{uuid.uuid4().hex[:8]}.mp4", Config=TransferConfig())
        return time.perf_counter() - t0

    run_ours(), run_plain()  # warm-up: the first write to a fresh SeaweedFS grows a volume (~1 s)
    ours, theirs = [], []
    for rep in range(reps):  # interleaved, alternating who goes first
        if rep % 2:
            theirs.append(run_plain())
            ours.append(run_ours())
        else:
            ours.append(run_ours())
            theirs.append(run_plain())
    size_gb = mib * (1 << 20) / 1e9
    ours_gbps = size_gb / statistics.median(ours)
    plain_gbps = size_gb / statistics.median(theirs)
    rec = {"bench": "upload", "mib": mib, "reps": reps, "ours_gbps": round(ours_gbps, 3),
           "plain_boto3_gbps": round(plain_gbps, 3), "ratio": round(ours_gbps / plain_gbps, 3),
           "ours_s": [round(x, 3) for x in ours], "plain_s": [round(x, 3) for x in theirs],
           "sha256_gbps": round(size_gb / sha_s, 3),
           "ours_part_mib": settings.upload_multipart_chunksize >> 20,
           "ours_concurrency": settings.upload_max_concurrency}  # fmt: skip
    emit(rec)
    spool.release(entry)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", default="cpu:1")
    ap.add_argument("--latency-jobs", type=int, default=30)
    ap.add_argument("--backlog", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--upload-mib", type=int, default=256)
    ap.add_argument("--upload-reps", type=int, default=3)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ltx-bench-service-"))
    redis, s3 = RedisServer().start(), S3Server().start()
    emit({"bench": "setup", "redis": redis.url, "s3": s3.url, "group": args.group, "cpus": os.cpu_count()})
    try:
        upload = bench_upload(s3, args.upload_mib, args.upload_reps, tmp)
        w = Worker(redis, s3, args.group, tmp, runner_setup=json.dumps({"output_bytes": 4096, "step_delay_s": 0.005}))
        try:
            e2s = bench_enqueue_to_start(w, args.latency_jobs)
            y2s = bench_yield_to_stream(w, args.steps)
        finally:
            w.stop()
        w = Worker(redis, s3, args.group, tmp, runner_setup=json.dumps({"output_bytes": 4096}))
        try:
            jps = bench_jobs_per_second(w, args.backlog, args.group)
        finally:
            w.stop()
    finally:
        redis.cleanup()
        s3.cleanup()
    summary = {
        "enqueue_to_start_p50_ms": e2s["p50_ms"],
        "enqueue_to_start_p99_ms": e2s["p99_ms"],
        "yield_to_stream_p50_ms": y2s["p50_ms"],
        "yield_to_stream_p99_ms": y2s["p99_ms"],
        "yield_to_reader_p50_ms": y2s["reader"]["p50_ms"],
        "jobs_per_s_per_fleet": jps["jobs_per_s"],
        "upload_gbps": upload["ours_gbps"],
        "plain_boto3_gbps": upload["plain_boto3_gbps"],
        "upload_ratio": upload["ratio"],
    }
    checks = {
        "enqueue_to_start_p50_lt_50ms": e2s["p50_ms"] < 50,
        "yield_to_stream_p50_lt_10ms": y2s["p50_ms"] < 10,
        "upload_ratio_ge_0.9": upload["ratio"] >= 0.9,
    }
    emit({"summary": summary, "targets_met": checks})


if __name__ == "__main__":
    main()
