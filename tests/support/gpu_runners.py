"""Helpers for the GPU tests of fleets on real devices: a runner that says where it runs, and which processes
`nvidia-smi` sees on which GPU. No test functions here.

The runner lives under tests/ on purpose: the controller ships runner classes by value.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ltx_mgpu import MGPURunner
from ltx_mgpu.control.devices import MULTICAST_OFF_ENV


def _uuid(text: str) -> str:
    return text.strip().lower().removeprefix("gpu-")


class DeviceProbeRunner(MGPURunner):
    """Reports where each rank runs (device, current device, the GPU's UUID, pid, NVLink-multicast env).

    `setup(hold_fraction=f)` allocates and touches f of the GPU's memory and keeps it (a model stand-in), so
    a second fleet on the same GPU fits only once the first has let go of it. A job yields `started`, keeps
    its GPU busy with matmuls for `busy_s`, joins a collective (`x`, if given, was broadcast from rank 0),
    then yields the report.
    """

    def setup(self, *, hold_fraction: float = 0.0) -> None:
        self.held = None
        if hold_fraction:
            _free, total = torch.cuda.mem_get_info(self.device)
            self.held = torch.ones(int(total * hold_fraction), dtype=torch.uint8, device=self.device)

    def __call__(
        self, *, busy_s: float = 0.0, x: torch.Tensor | None = None, output_path: str | None = None
    ) -> Iterator[Any]:
        start = time.time()
        yield {"rank": self.rank, "event": "started", "at": start}
        a = torch.randn(2048, 2048, device=self.device)
        iters = 0
        while True:
            a = torch.tanh(a @ a)
            iters += 1
            torch.cuda.synchronize(self.device)
            if time.time() - start >= busy_s:
                break
        total = torch.tensor([float(self.rank)], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(total, group=self.groups.transformer_group)
        if output_path and self.is_driver:
            with open(output_path, "wb") as fh:
                fh.write(b"probe")
        yield {
            "rank": self.rank,
            "event": "report",
            "pid": os.getpid(),
            "device": str(self.device),
            "current": torch.cuda.current_device(),
            "uuid": _uuid(str(torch.cuda.get_device_properties(self.device).uuid)),
            "rank_sum": float(total.item()),
            "x_sum": None if x is None else float(x.float().sum().item()),
            "x_device": None if x is None else str(x.device),
            "env": {k: os.environ.get(k) for k in MULTICAST_OFF_ENV},
            "start": start,
            "end": time.time(),
            "iters": iters,
        }


def _smi(*query: str) -> list[list[str]]:
    smi = shutil.which("nvidia-smi")
    assert smi is not None
    out = subprocess.run([smi, *query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                         check=True).stdout  # fmt: skip
    rows = [[part.strip() for part in line.split(",")] for line in out.strip().splitlines()]
    return [row for row in rows if len(row) >= 2]  # ("No running processes found" has no comma)


def gpu_processes() -> dict[str, set[int]] | None:
    """GPU UUID (lower case, no "GPU-" prefix) -> pids of compute processes on it, from nvidia-smi; None if
    nvidia-smi is missing. Asks from outside, so the caller never creates a CUDA context of its own."""
    if shutil.which("nvidia-smi") is None:
        return None
    found: dict[str, set[int]] = {_uuid(uuid): set() for _index, uuid in _smi("--query-gpu=index,uuid")}
    for pid, uuid in _smi("--query-compute-apps=pid,gpu_uuid"):
        found.setdefault(_uuid(uuid), set()).add(int(pid))
    return found


def check_placement(reports: list[dict[str, Any]], *, absent: list[int]) -> str:
    """Every rank's pid is on its own GPU and on no other; no pid of `absent` is on any GPU. Returns a note
    when nvidia-smi cannot tell (missing, or it lists other pid namespaces' processes)."""
    listing = gpu_processes()
    if listing is None:
        return "nvidia-smi not found: placement not checked"
    every = set().union(*listing.values()) if listing else set()
    if not any(r["pid"] in every for r in reports):
        return f"nvidia-smi lists none of the rank pids ({sorted(every)}): another pid namespace; not checked"
    by_uuid = all(r["uuid"] in listing for r in reports)  # torch's UUID text matches nvidia-smi's
    for r in reports:
        where = sorted(u for u, pids in listing.items() if r["pid"] in pids)
        assert len(where) == 1, f"rank {r['rank']} (pid {r['pid']}) holds contexts on {where}"
        assert where == [r["uuid"]] or not by_uuid, f"rank {r['rank']} on {where}, expected {r['uuid']}"
    gpus = {r["device"]: next(u for u, pids in listing.items() if r["pid"] in pids) for r in reports}
    assert len(set(gpus.values())) == len(gpus), f"ranks of different devices share a GPU: {gpus}"
    stray = {pid: sorted(u for u, pids in listing.items() if pid in pids) for pid in absent if pid in every}
    assert not stray, f"processes that must hold no CUDA context are on GPUs: {stray}"
    return "placement checked with nvidia-smi" + ("" if by_uuid else " (by pid; UUID texts differ)")
