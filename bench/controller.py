"""Control-plane latency and bandwidth on CPU ranks (gloo).

Prints one JSON line per measurement and a final summary line. Measures, in the same run:
- no-op job round trip (dispatch → every rank's terminal collected), p50/p99, worlds 1, 2, 4;
- dispatch → first yield latency, p50/p99;
- a 256 MiB top-level tensor kwarg delivered to every rank (GB/s), against a plain `dist.broadcast` of a
  tensor of the same size between the same ranks (the ratio is what the issue targets: >= 0.5);
- fleet start time (spawn → every rank's setup done) with a no-op runner.

Usage: python -m bench.controller [--worlds 1,2,4] [--reps 300] [--mib 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bench.common import emit, emit_summary, pct
from ltx_mgpu import MGPUController, MGPURunner


class BenchRunner(MGPURunner):
    def setup(self) -> None:
        pass

    def __call__(self, *, mode: str = "noop", x: torch.Tensor | None = None, mib: int = 0) -> Iterator[Any]:
        if mode == "first_yield":
            yield self.rank
        elif mode == "broadcast":
            t = torch.empty(mib * 2**20, dtype=torch.uint8)
            if self.rank == 0:
                t.fill_(1)
            dist.barrier(group=self.groups.transformer_group)
            t0 = time.perf_counter()
            dist.broadcast(t, src=0, group=self.groups.transformer_group)
            return time.perf_counter() - t0
        elif mode == "deliver":
            assert x is not None
            return int(x[-1].item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensor-reps", type=int, default=5)
    args = ap.parse_args()
    summary: dict[str, Any] = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        t0 = time.perf_counter()
        ctl = MGPUController(BenchRunner, devices=["cpu"] * world)
        ctl.start(timeout=300)
        start_s = time.perf_counter() - t0
        emit({"metric": "fleet_start_s", "world": world, "value": round(start_s, 3)})
        try:
            for _ in range(20):  # warm-up
                list(ctl.stream())
            rtt = []
            for _ in range(args.reps):
                t = time.perf_counter()
                list(ctl.stream())
                rtt.append(time.perf_counter() - t)
            first = []
            for _ in range(args.reps):
                t = time.perf_counter()
                s = ctl.stream(mode="first_yield")
                next(s)
                first.append(time.perf_counter() - t)
                s.drain()
            rec = {
                "metric": "noop_round_trip_ms",
                "world": world,
                "p50": round(pct(rtt, 50) * 1e3, 3),
                "p99": round(pct(rtt, 99) * 1e3, 3),
                "reps": args.reps,
            }
            emit(rec)
            emit(
                {
                    "metric": "dispatch_to_first_yield_ms",
                    "world": world,
                    "p50": round(pct(first, 50) * 1e3, 3),
                    "p99": round(pct(first, 99) * 1e3, 3),
                }
            )
            summary[f"rtt_p50_ms_w{world}"] = rec["p50"]
            summary[f"start_s_w{world}"] = round(start_s, 2)
            if world > 1:
                nbytes = args.mib * 2**20
                deliver, bcast = [], []
                for _ in range(args.tensor_reps):
                    x = torch.ones(nbytes, dtype=torch.uint8)  # fresh, not yet in shared memory
                    t = time.perf_counter()
                    s = ctl.stream(mode="deliver", x=x)
                    s.drain()
                    deliver.append(time.perf_counter() - t)
                    s = ctl.stream(mode="broadcast", mib=args.mib)
                    s.drain()
                    bcast.append(max(s.result))
                d, b = statistics.median(deliver), statistics.median(bcast)
                rec = {
                    "metric": "tensor_kwarg_delivery",
                    "world": world,
                    "mib": args.mib,
                    "deliver_gbps": round(nbytes / d / 1e9, 3),
                    "plain_broadcast_gbps": round(nbytes / b / 1e9, 3),
                    "ratio_vs_broadcast": round(b / d, 3),
                }
                emit(rec)
                summary[f"tensor_ratio_w{world}"] = rec["ratio_vs_broadcast"]
        finally:
            ctl.shutdown(graceful_timeout=10)
    emit_summary(summary)


if __name__ == "__main__":
    main()
