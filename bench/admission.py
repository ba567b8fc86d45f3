"""What worker-side admission (`worker/rq/loop/admission.py`) costs a dequeue, with long queues.

Against a real redis-server on this machine (loopback), `--jobs` (10,000) raw RQ jobs waiting in one queue,
each with a producer-like meta naming one of 50 clients. Measured, median of `--repeats` (5), in ms:

- the raw reads a pass could make: LRANGE of the whole queue; status + meta length (HGET + HSTRLEN) of every
  job in one pipeline; every job's meta (HGET) in one pipeline;
- one pass as a dequeue runs it: depth cap only and within the cap (one LLEN round trip, `before_dequeue`);
  the quota on, first pass (owners not cached: reads `QUOTA_WINDOW` metas) and later passes (cached), with
  no depth cap (window `QUOTA_WINDOW`) and once the queue is at `--cap` (window: the cap);
- a flood past the cap: one pass that moves the whole excess out of the queue (`--jobs` - `--cap`), and the
  rate at which refusals are then recorded (jobs/s: meta, `failed` event, RQ failed registry, result).

One JSON line per measurement; the last line is `SUMMARY {...}` with the ratios of a cached quota pass to a
whole-queue scan of statuses (what a pass would cost if it read every waiting job), measured side by side.

Usage: python -m bench.admission [--jobs 10000] [--cap 200] [--quota 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from rq import Queue
from rq.serializers import JSONSerializer

from bench.common import emit, emit_summary
from devstack.dev_servers import RedisServer
from ltx_contract.keys import REFUSALS_KEY, RENDER_FUNC
from worker.jobs.outcomes import JobOutcomes
from worker.rq.loop.admission import QUOTA_WINDOW, Admission
from worker.rq.loop.job_class import RenderJob
from worker.settings import WorkerSettings


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(samples), 3)


def _fill(conn: Any, queue: Queue, jobs: int) -> list[str]:
    ids = []
    with conn.pipeline() as pipe:
        for i in range(jobs):
            job = queue.create_job(RENDER_FUNC, args=({"prompt": f"p{i}"},), meta={"state": "queued",
                                   "client": f"client{i % 50}", "submitted_at": time.time()})  # fmt: skip
            queue.enqueue_job(job, pipeline=pipe)
            ids.append(job.id)
        pipe.execute()
    return ids


def _admission(conn: Any, queue: Queue, *, cap: int | None, quota: int | None) -> Admission:
    settings = WorkerSettings(queues=[queue.name], metrics_port=None)
    return Admission(conn, [queue], depth_cap=cap, quota=quota, worker_name="bench",
                     outcomes=JobOutcomes(settings, worker_name="bench"), job_class=RenderJob,
                     max_meta_bytes=settings.max_meta_bytes)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--cap", type=int, default=200)
    ap.add_argument("--quota", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    server = RedisServer().start()
    out: dict[str, Any] = {"jobs": args.jobs, "cap": args.cap, "quota_window": QUOTA_WINDOW}

    def measure(name: str, **values: Any) -> None:
        emit({"measure": name, **values})
        out[name] = values

    try:
        conn = server.client()
        queue = Queue("bench-admission", connection=conn, serializer=JSONSerializer)
        ids = _fill(conn, queue, args.jobs)
        keys = [RenderJob.key_for(i) for i in ids]

        def statuses() -> None:
            pipe = conn.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "status")
                pipe.hstrlen(key, "meta")
            pipe.execute()

        def metas() -> None:
            pipe = conn.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "meta")
            pipe.execute()

        measure("lrange_all_ms", value=_ms(lambda: conn.lrange(queue.key, 0, -1), args.repeats))
        measure("status_and_meta_len_all_ms", value=_ms(statuses, args.repeats))
        measure("meta_all_ms", value=_ms(metas, args.repeats))

        within = _admission(conn, queue, cap=args.jobs + 1, quota=None)
        measure("depth_pass_within_cap_ms", value=_ms(within.before_dequeue, args.repeats))
        cold = _admission(conn, queue, cap=None, quota=args.jobs)  # a quota nobody exceeds: reads, no refusal
        measure("quota_pass_cold_ms", value=_ms(lambda: cold.police(None), 1))
        measure("quota_pass_cached_ms", value=_ms(lambda: cold.police(None), args.repeats))
        assert conn.llen(queue.key) == args.jobs

        flood = _admission(conn, queue, cap=args.cap, quota=None)
        t_trim = _ms(lambda: flood.police(None), 1)
        refused = conn.llen(REFUSALS_KEY)
        measure("trim_excess_ms", value=t_trim, excess=refused, left=conn.llen(queue.key))
        capped = _admission(conn, queue, cap=args.cap, quota=args.jobs)  # the queue is at the cap now
        measure("quota_pass_at_cap_cold_ms", value=_ms(lambda: capped.police(None), 1))
        measure("quota_pass_at_cap_cached_ms", value=_ms(lambda: capped.police(None), args.repeats))
        t0 = time.perf_counter()
        recorded = flood.drain()
        elapsed = time.perf_counter() - t0
        measure("record_refusals", jobs=recorded, seconds=round(elapsed, 3), per_s=round(recorded / elapsed, 1))
        summary = {
            "quota_pass_cached_ms": out["quota_pass_cached_ms"]["value"],
            "whole_queue_status_scan_ms": out["status_and_meta_len_all_ms"]["value"],
            "scan_over_pass": round(
                out["status_and_meta_len_all_ms"]["value"] / max(out["quota_pass_cached_ms"]["value"], 1e-6), 2
            ),
            "quota_pass_at_cap_cached_ms": out["quota_pass_at_cap_cached_ms"]["value"],
            "depth_pass_within_cap_ms": out["depth_pass_within_cap_ms"]["value"],
            "trim_excess_ms": t_trim,
            "refusals_recorded_per_s": out["record_refusals"]["per_s"],
        }
        emit_summary(summary)
    finally:
        server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
