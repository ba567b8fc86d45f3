"""A real out-of-memory error in each stage of a job on a GPU fleet: the job ends, the fleet and its memory stay.

docs/memory.md says an out-of-memory error fails one job, not the fleet: the rank drops the job's references
and empties its allocator cache before it reports (`RenderOutOfMemory`), and the next job runs on the same
processes. On CPU ranks the tests inject the error; here the device really runs out: in each stage the job
holds `--hold-gib` of device memory and then asks for more than the whole device. Per stage it reports
whether the job ended as an out-of-memory error on every rank, whether the ranks kept their pids, and how much
device memory the ranks still held afterwards (allocated and reserved, from a probe job: both should be back
where they were before the first job). It also reports `device_memory_bytes` of the runners' stage clock
(free + this rank's reservation: the capacity the worker's memory plan uses) against the device's total.

Prints one JSON line per stage and a final `SUMMARY {...}` line. Needs torch with CUDA only (no ltx-core):

    python -m bench.oom_fleet --devices 0                # one H200, about 15 s
    python -m bench.oom_fleet --devices 0,0 --hold-gib 8   # two ranks sharing it (gloo)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench.common import emit, emit_summary
from ltx_mgpu import MGPUController, MGPURunner, SymmetricRunnerError
from ltx_mgpu.runners.common.stages import StageClock

STAGES = ("encode", "stage1", "upsample", "stage2", "decode")
GIB = 1 << 30


class OomRunner(MGPURunner):
    """Each job walks the stages; in `oom_stage` it holds `hold_gib` and asks for twice the device."""

    def setup(self) -> None:
        self.clock = StageClock(self.device)

    def __call__(self, *, mode: str = "run", oom_stage: str = "", hold_gib: float = 1.0) -> Iterator[Any]:
        dev = self.device
        if mode == "probe":
            torch.cuda.synchronize(dev)
            free, total = torch.cuda.mem_get_info(dev)
            yield {"rank": self.rank, "free": free, "total": total, "allocated": torch.cuda.memory_allocated(dev),
                   "reserved": torch.cuda.memory_reserved(dev), **self.clock.gpu_report()}  # fmt: skip
            return
        self.clock.reset()
        held: list[torch.Tensor] = []
        for stage in STAGES:
            with self.clock.stage(stage):
                held.append(torch.ones(int(hold_gib * GIB) // 2, dtype=torch.bfloat16, device=dev))
                if stage == oom_stage:
                    _free, total = torch.cuda.mem_get_info(dev)
                    held.append(torch.empty(2 * total, dtype=torch.uint8, device=dev))  # a real allocation failure
            yield {"rank": self.rank, "stage": stage}
        yield {"rank": self.rank, "done": True, **self.clock.gpu_report()}


def probe(ctl: MGPUController) -> list[dict[str, Any]]:
    return [x for x in ctl.stream(timeout=60, mode="probe") if isinstance(x, dict)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0", help="comma-separated CUDA indices, one rank each")
    ap.add_argument("--hold-gib", type=float, default=4.0, help="GiB a job holds per stage before the failure")
    args = ap.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",") if d.strip()]
    t0 = time.monotonic()
    ctl = MGPUController(OomRunner, devices=devices)
    ctl.start(timeout=120)
    results = []
    try:
        pids = ctl.pids
        list(ctl.stream(timeout=60, mode="run", hold_gib=args.hold_gib))  # warm: the allocator's pools exist
        before = probe(ctl)
        for stage in STAGES:
            t = time.monotonic()
            outcome = "finished"
            try:
                list(ctl.stream(timeout=120, mode="run", oom_stage=stage, hold_gib=args.hold_gib))
            except SymmetricRunnerError as exc:
                outcome = "out_of_memory" if exc.out_of_memory else f"error: {exc}"
            except Exception as exc:  # (anything else is a finding: print it)
                outcome = f"{type(exc).__name__}: {exc}"
            after = probe(ctl) if ctl.is_alive else []
            rec = {"kind": "stage", "stage": stage, "outcome": outcome, "alive": ctl.is_alive,
                   "same_pids": ctl.is_alive and ctl.pids == pids, "seconds": round(time.monotonic() - t, 3),
                   "allocated_mib_after": [round(a["allocated"] / 2**20, 1) for a in after],
                   "allocated_mib_before": [round(b["allocated"] / 2**20, 1) for b in before],
                   "reserved_gib_after": [round(a["reserved"] / GIB, 2) for a in after]}  # fmt: skip
            emit(rec)
            results.append(rec)
            if not ctl.is_alive:
                break
        # (the whole stream: stopping at the first `done` left the job in flight and the next call refused)
        next_job = list(ctl.stream(timeout=60, mode="run")) if ctl.is_alive else []
        ok_after = any(isinstance(x, dict) and x.get("done") for x in next_job)
        last = probe(ctl) if ctl.is_alive else []
    finally:
        ctl.shutdown(graceful_timeout=10)
    summary = {
        "devices": devices,
        "hold_gib": args.hold_gib,
        "stages": len(results),
        "every_stage_out_of_memory": all(r["outcome"] == "out_of_memory" for r in results) and len(results) == 5,
        "fleet_kept": all(r["same_pids"] for r in results),
        "next_job_rendered": ok_after,
        "max_leak_mib": max(
            (a - b for r in results for a, b in zip(r["allocated_mib_after"], r["allocated_mib_before"], strict=False)),
            default=None,
        ),
        "device_memory_gib": [round(p.get("device_memory_bytes", 0) / GIB, 2) for p in last],
        "total_gib": [round(p["total"] / GIB, 2) for p in last],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    emit_summary(summary)
    return 0 if summary["every_stage_out_of_memory"] and summary["fleet_kept"] and ok_after else 1


if __name__ == "__main__":
    raise SystemExit(main())
