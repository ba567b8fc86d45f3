"""Throughput under a backlog: does the fleet wait on uploads, Redis or bookkeeping between jobs?

One CPU fleet (`--group`, default cpu:1) drains `--jobs` (50) queued renders of the smoke runner, each
video padded to a realistic size (`--pad-mb`, 50 MB: a trailing MP4 `free` box, so the file stays a valid
mp4), uploaded to a real SeaweedFS through a throttling proxy that makes the bucket remote-like
(`--s3-mbps` shared upload bandwidth, `--latency-ms` per connection and per response chunk). The same run
does it twice, with the background uploader on (`LTX_UPLOAD_PIPELINE=true`) and off (synchronous upload
inside the job), and reports for each:

- the fleet's idle gap between consecutive jobs: the driver rank stamps (wall clock) when a job enters
  the runner and when its padded file is complete; gap = next start - previous end, p50/p99/max;
- total wall time: first enqueue → last job `uploaded` (every object confirmed in S3 with its sha256);
- render and upload seconds per job (p50), and the worker's back-pressure seconds.

Prints one JSON line per mode and a summary line with the wall-time ratio (off / on).
Target: idle gap p50 < 50 ms with the pipeline on.

Usage: python -m bench.backlog [--jobs 50] [--pad-mb 50] [--s3-mbps 100] [--latency-ms 20]
                                         [--group cpu:1] [--size 128] [--frames 17] [--steps 16]
                                         [--modes on,off]
(defaults: a ~0.5-0.8 s smoke render per job on this 2-core VM, so 100 MB/s of bandwidth can keep up)
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from typing import Any

from ltx_mgpu.runners.smoke.runner import SmokeRunner

_RUNNER_PATH = "bench.backlog:PaddedSmokeRunner"


class PaddedSmokeRunner(SmokeRunner):
    """The smoke runner, its mp4 padded to `pad_bytes` with a trailing `free` box, stamping job start/end
    (driver rank, wall clock) into `record` (one JSON line per job)."""

    def setup(self, *, pad_bytes: int = 0, record: str | None = None, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.pad_bytes = int(pad_bytes)
        self.record = record

    def __call__(self, *, output_path: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        t_start = time.time()
        for event in super().__call__(output_path=output_path, **kwargs):
            out = event
            if isinstance(event, dict) and event.get("type") == "output":
                size = os.path.getsize(output_path)
                pad = self.pad_bytes - size
                if pad > 8:
                    with open(output_path, "ab") as fh:
                        fh.write(struct.pack(">I4s", pad, b"free"))
                        fh.write(bytes(pad - 8))
                    out = {**event, "bytes": pad + size}
                t_end = time.time()
                if self.record:
                    import json

                    job = os.path.basename(os.path.dirname(output_path))
                    with open(self.record, "a") as fh:
                        fh.write(json.dumps({"job": job, "start": t_start, "end": t_end}) + "\n")
            yield out


# ==== the benchmark (runs only as a script; the ranks import this module for the runner alone) ===========


def main() -> None:
    import argparse
    import itertools
    import json
    import statistics
    import subprocess
    import sys
    import tempfile
    import uuid
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent  # the checkout: the worker runs from it
    from rq import Queue
    from rq.serializers import JSONSerializer

    from bench.common import emit, pct
    from devstack.dev_servers import RedisServer, S3Server
    from devstack.tcp_proxy import TcpProxy
    from ltx_contract.keys import RENDER_FUNC

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--pad-mb", type=float, default=50.0)
    ap.add_argument("--s3-mbps", type=float, default=100.0, help="upload bandwidth to S3, MB/s (0: unthrottled)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--group", default="cpu:1")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--size", type=int, default=128, help="width = height of the smoke render")
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--max-pending", type=int, default=8)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ltx-backlog-"))
    redis_srv = RedisServer().start()
    s3 = S3Server().start()
    proxy = TcpProxy(s3.s3_port, rate_bytes_per_s=args.s3_mbps * 1e6 or None, latency_s=args.latency_ms / 1000)
    proxy.start()
    conn = redis_srv.client()
    s3c = s3.client()
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            run = tmp / mode
            run.mkdir()
            record = run / "record.jsonl"
            queue, name = f"backlog-{uuid.uuid4().hex[:6]}", f"backlog{uuid.uuid4().hex[:6]}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
            env.update(
                LTX_REDIS_URL=redis_srv.url, LTX_QUEUES=queue, LTX_WORKER_NAME=name,
                LTX_RUNNERS=json.dumps({"padded": _RUNNER_PATH}), LTX_RUNNER="padded",
                LTX_RUNNER_SETUP=json.dumps({"pad_bytes": int(args.pad_mb * 1e6), "record": str(record),
                                             "default_steps": args.steps}),
                LTX_SPOOL_DIR=str(run / "spool"), LTX_S3_ENDPOINT_URL=proxy.url, LTX_S3_BUCKET=s3.bucket,
                LTX_S3_ACCESS_KEY_ID=s3.access_key, LTX_S3_SECRET_ACCESS_KEY=s3.secret_key,
                LTX_METRICS_PORT="0", LTX_METRICS_HOST="127.0.0.1", LTX_LOG_LEVEL="WARNING",
                LTX_UPLOAD_PIPELINE="true" if mode == "on" else "false",
                LTX_MAX_PENDING_UPLOADS=str(args.max_pending),
                PYTHONPATH=str(root),
            )  # fmt: skip
            log = (run / "worker.log").open("wb")
            proc = subprocess.Popen([sys.executable, "-m", "worker", "one", "--group", args.group], env=env,
                                    cwd=root, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            try:
                deadline = time.monotonic() + 300
                while not any(conn.scan_iter(match=f"ltx:worker:{name}.*:health")):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"worker did not start:\n{(run / 'worker.log').read_text()[-3000:]}")
                    time.sleep(0.1)
                q = Queue(queue, connection=conn, serializer=JSONSerializer)
                request = {"prompt": "a backlog", "width": args.size, "height": args.size,
                           "num_frames": args.frames, "steps": args.steps}  # fmt: skip
                t0 = time.time()
                with conn.pipeline() as pipe:
                    jobs = [q.enqueue(RENDER_FUNC, {**request, "seed": i}, job_timeout=3600, result_ttl=3600,
                                      pipeline=pipe) for i in range(args.jobs)]  # fmt: skip
                    pipe.execute()
                pending = {j.id for j in jobs}
                metas: dict[str, dict[str, Any]] = {}
                deadline = time.monotonic() + 3600
                while pending:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"worker died or timed out:\n{(run / 'worker.log').read_text()[-3000:]}")
                    for job in jobs:
                        if job.id in pending:
                            meta = job.get_meta(refresh=True)
                            if meta.get("state") in ("uploaded", "failed", "cancelled"):
                                pending.discard(job.id)
                                metas[job.id] = meta
                    time.sleep(0.05)
                wall = max(m["updated_at"] for m in metas.values()) - t0
                failed = [j for j, m in metas.items() if m["state"] != "uploaded"]
                for m in metas.values():  # every object really is in the bucket with its sha256
                    if m["state"] == "uploaded":
                        r = m["result"]
                        head = s3c.head_object(Bucket=r["bucket"], Key=r["key"])
                        assert head["Metadata"]["sha256"] == r["sha256"] and head["ContentLength"] == r["size"]
                        s3c.delete_object(Bucket=r["bucket"], Key=r["key"])  # keep the disk small
                stamps = sorted((json.loads(line) for line in record.read_text().splitlines()),
                                key=lambda s: s["start"])  # fmt: skip
                gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(stamps)]
                renders = [s["end"] - s["start"] for s in stamps]
                uploads = [m["result"]["timings"]["upload_s"] for m in metas.values() if m.get("result")]
                health = next(conn.scan_iter(match=f"ltx:worker:{name}.*:health"), None)
                port = json.loads(conn.get(health))["metrics_port"] if health else None
                bp_s = None
                if port:
                    bp_s = 0.0  # the counter has no sample until the worker first waited
                    import urllib.request

                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        for line in resp.read().decode().splitlines():
                            if line.startswith("ltx_worker_backpressure_seconds_total"):
                                bp_s = round(float(line.split()[-1]), 3)
                sizes = [m["result"]["size"] for m in metas.values() if m.get("result")]
                rec = {
                    "bench": "backlog",
                    "pipeline": mode,
                    "jobs": args.jobs,
                    "failed": len(failed),
                    "file_mb": round(statistics.fmean(sizes) / 1e6, 2),
                    "gap_p50_ms": round(pct(gaps, 50) * 1000, 2),
                    "gap_p99_ms": round(pct(gaps, 99) * 1000, 2),
                    "gap_max_ms": round(max(gaps) * 1000, 2),
                    "gap_mean_ms": round(statistics.fmean(gaps) * 1000, 2),
                    "render_p50_s": round(pct(renders, 50), 3),
                    "upload_p50_s": round(pct(uploads, 50), 3),
                    "wall_s": round(wall, 2),
                    "jobs_per_min": round(60 * args.jobs / wall, 2),
                    "backpressure_s": bp_s,
                    "s3_mbps": args.s3_mbps,
                    "latency_ms": args.latency_ms,
                    "group": args.group,
                }
                results[mode] = rec
                emit(rec)
            finally:
                proc.terminate()
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
                log.close()
        summary: dict[str, Any] = {"bench": "backlog", "summary": True, "target_gap_p50_ms": 50}
        if "on" in results:
            summary["gap_p50_ms_on"] = results["on"]["gap_p50_ms"]
            summary["gap_p99_ms_on"] = results["on"]["gap_p99_ms"]
            summary["target_met"] = results["on"]["gap_p50_ms"] < 50
        if "off" in results:
            summary["gap_p50_ms_off"] = results["off"]["gap_p50_ms"]
        if "on" in results and "off" in results:
            summary["wall_s_on"], summary["wall_s_off"] = results["on"]["wall_s"], results["off"]["wall_s"]
            summary["wall_ratio_off_over_on"] = round(results["off"]["wall_s"] / results["on"]["wall_s"], 3)
        emit(summary)
    finally:
        proxy.block()
        conn.close()
        s3.cleanup()
        redis_srv.cleanup()


if __name__ == "__main__":
    main()
