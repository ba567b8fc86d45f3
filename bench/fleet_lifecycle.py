"""Fleet start and rebuild-after-poison times.

For each world size: start a fleet (spawn → every rank's setup done), poison it by killing one rank
mid-job, and rebuild it (`shutdown()` + `start()`), timing the detection and the rebuild. Prints JSON
lines and a summary line.

Usage:
  python -m bench.fleet_lifecycle --worlds 1,2,4 --device cpu
  python -m bench.fleet_lifecycle --worlds 1,2,4,8 --device cuda-shared   # W ranks on cuda:0 (gloo)
  python -m bench.fleet_lifecycle --worlds 2,4,8 --device cuda            # one GPU per rank (NCCL)
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench.common import emit, emit_summary
from ltx_mgpu import FleetFailure, MGPUController, MGPURunner


class LifecycleRunner(MGPURunner):
    def setup(self) -> None:
        if self.device.type == "cuda":
            torch.ones(1, device=self.device).sum().item()  # create the CUDA context inside setup

    def __call__(self, *, die: bool = False) -> Iterator[Any]:
        if die and self.rank == self.world_size - 1:
            os._exit(9)
        yield self.rank
        if die:
            time.sleep(60)


def _devices(kind: str, world: int) -> tuple[list[Any], bool]:
    if kind == "cpu":
        return ["cpu"] * world, False
    if kind == "cuda-shared":
        return [0] * world, world > 1
    return list(range(world)), False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--device", choices=["cpu", "cuda", "cuda-shared"], default="cpu")
    args = ap.parse_args()
    summary: dict[str, Any] = {"device": args.device}
    for world in [int(w) for w in args.worlds.split(",")]:
        devices, shared = _devices(args.device, world)
        ctl = MGPUController(LifecycleRunner, devices=devices, allow_shared_devices=shared)
        t0 = time.perf_counter()
        ctl.start(timeout=600)
        start_s = time.perf_counter() - t0
        list(ctl.stream())
        stream = ctl.stream(die=True)
        t_dispatch = time.time()
        try:
            for _ in stream:
                pass
        except FleetFailure as err:
            detect_s = err.detected_at - t_dispatch
        t1 = time.perf_counter()
        ctl.shutdown(graceful_timeout=0)
        ctl.start(timeout=600)
        rebuild_s = time.perf_counter() - t1
        assert len(list(ctl.stream())) == world
        ctl.shutdown(graceful_timeout=30)
        rec = {
            "world": world,
            "backend": ctl.backend,
            "start_s": round(start_s, 3),
            "death_detected_after_dispatch_s": round(detect_s, 3),
            "rebuild_s": round(rebuild_s, 3),
        }
        emit(rec)
        summary[f"w{world}"] = {"start_s": rec["start_s"], "rebuild_s": rec["rebuild_s"]}
    emit_summary(summary)


if __name__ == "__main__":
    main()
