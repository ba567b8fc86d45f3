"""The host side of a GPU box, measured: what the memory plan's placement tiers cost (docs/memory.md, "Placement").

A component the plan keeps in pinned host memory is copied to the GPU when a job needs it (the LoRA tracker's
clean copy, a parked text encoder); its cost in seconds is its bytes over the pinned host-to-device bandwidth
measured here. Reported, each as one JSON line:

- `pin`: seconds to allocate and page-lock N GiB of host memory (`torch.empty(pin_memory=True)`): the cold-start
  cost of a host tier.
- `h2d_pinned` / `d2h_pinned` / `h2d_pageable`: one copy of N GiB timed with CUDA events (best of `--iters`),
  GB/s = 1e9 bytes per second.
- `h2d_overlap`: the same pinned copy on a side stream while the default stream runs bf16 matrix products: the
  copy's and the products' seconds alone and together (does a transfer hide behind compute).
- `host`: MemTotal / MemAvailable, /dev/shm and the working folder's free space, CPU count.
- `disk`: with `--disk DIR`, write and read back `--disk-gib` through the page cache (fdatasync'd), GB/s.

The summary line has the pinned H2D GB/s the plan's `H2D_GBPS` default was read from, and the overlap ratio.

    python -m bench.host_link --gib 8 --iters 3 --disk /tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

from bench.common import emit, emit_summary, say

GB = 1e9
GIB = float(1 << 30)


def _meminfo() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, value = line.split(":", 1)
                if name in ("MemTotal", "MemAvailable", "Shmem", "Mlocked"):
                    out[name + "_gib"] = round(int(value.split()[0]) * 1024 / GIB, 2)
    except OSError:
        pass
    return out


def host_facts(workdir: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"kind": "host", "cpus": os.cpu_count(), **_meminfo()}
    for label, path in (("shm", "/dev/shm"), ("work", workdir)):
        try:
            usage = shutil.disk_usage(path)
            facts[f"{label}_free_gib"] = round(usage.free / GIB, 2)
            facts[f"{label}_total_gib"] = round(usage.total / GIB, 2)
        except OSError:
            pass
    return facts


def disk_speed(folder: str, gib: float) -> dict[str, Any]:
    """Write then read `gib` GiB in 64 MiB blocks (fdatasync before the write's clock stops)."""
    path = os.path.join(folder, f"host_link_probe.{os.getpid()}")
    block = os.urandom(64 << 20)
    n = max(1, int(gib * GIB) // len(block))
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(n):
                os.write(fd, block)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0
        try:  # drop this file's cached pages so the read goes to the device when the kernel allows it
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
        read_s = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.remove(path)
    nbytes = n * len(block)
    return {
        "kind": "disk",
        "folder": folder,
        "gib": round(nbytes / GIB, 2),
        "write_gbps": round(nbytes / write_s / GB, 2),
        "read_gbps": round(nbytes / read_s / GB, 2),
    }


def _copy_gbps(dst: Any, src: Any, iters: int) -> float:
    import torch

    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / best / GB


def link(gib: float, iters: int) -> list[dict[str, Any]]:
    import torch

    n = int(gib * GIB)
    device = torch.device("cuda", torch.cuda.current_device())
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    out.append({"kind": "pin", "gib": gib, "seconds": round(pin_s, 3), "gib_per_s": round(gib / pin_s, 2)})
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    pinned.fill_(1)
    out.append({"kind": "h2d_pinned", "gib": gib, "gbps": round(_copy_gbps(dev, pinned, iters), 2)})
    out.append({"kind": "d2h_pinned", "gib": gib, "gbps": round(_copy_gbps(pinned, dev, iters), 2)})
    small = int(min(gib, 2.0) * GIB)
    pageable = torch.ones(small, dtype=torch.uint8)
    gbps = _copy_gbps(dev[:small], pageable, iters)
    out.append({"kind": "h2d_pageable", "gib": round(small / GIB, 2), "gbps": round(gbps, 2)})
    del pageable
    # overlap: a copy on a side stream beside matrix products on the default stream
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def products(k: int) -> None:
        for _ in range(k):
            a @ a

    products(3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    products(40)
    torch.cuda.synchronize()
    compute_s = time.perf_counter() - t0
    side = torch.cuda.Stream(device)
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        dev.copy_(pinned, non_blocking=True)
    products(40)
    torch.cuda.synchronize()
    both_s = time.perf_counter() - t0
    hidden = (copy_s + compute_s - both_s) / min(copy_s, compute_s)  # 1: the shorter one fully hidden
    out.append(
        {
            "kind": "h2d_overlap",
            "gib": gib,
            "copy_s": round(copy_s, 4),
            "compute_s": round(compute_s, 4),
            "together_s": round(both_s, 4),
            "hidden": round(hidden, 3),
        }
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0, help="bytes per copy (GiB)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--disk", default=None, help="a folder to measure write/read speed in")
    ap.add_argument("--disk-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    facts = host_facts(args.disk or os.getcwd())
    emit(facts)
    summary: dict[str, Any] = {"mem_available_gib": facts.get("MemAvailable_gib")}
    if args.disk:
        say("host_link", f"disk speed in {args.disk}")
        record = disk_speed(args.disk, args.disk_gib)
        emit(record)
        summary.update(disk_write_gbps=record["write_gbps"], disk_read_gbps=record["read_gbps"])
    import torch

    if not torch.cuda.is_available():
        emit_summary({**summary, "gpu": None})
        return 0
    say("host_link", f"{torch.cuda.get_device_name()}: copies of {args.gib} GiB")
    for record in link(args.gib, args.iters):
        emit(record)
        summary[record["kind"]] = record.get("gbps", record.get("hidden", record.get("seconds")))
    summary["gpu"] = torch.cuda.get_device_name()
    emit_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
