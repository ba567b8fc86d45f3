"""Process helpers from Linux /proc, for production and the development servers alike: whether a process runs
(the dev servers and the demo leave nothing running), and waiting until a fleet's old ranks are gone and (where
NVML can tell) listed on no GPU, before a new fleet starts on those devices."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["await_released", "pid_alive"]

log = logging.getLogger("worker.ops.procs")


def pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    if pid <= 0:  # kill(0) and kill(-1) address process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def await_released(pids: Sequence[int], timeout: float) -> bool:
    """Wait until none of `pids` runs and (where NVML answers) no GPU lists any of them; True if so.

    A rank killed mid-job can take seconds to exit while the driver tears down a large context, and the
    controller's shutdown does not wait forever; a fleet started meanwhile would find its GPUs still full.
    NVML is optional (`nvidia-ml-py`): without it, or where it reports other pid namespaces' numbers,
    only the processes themselves are awaited.
    """
    deadline = time.monotonic() + timeout
    waiting = set(pids)
    while True:
        waiting = {pid for pid in waiting if pid_alive(pid)}
        on_gpu = _pids_on_gpus(set(pids)) if not waiting else set()
        if not waiting and not on_gpu:
            return True
        if time.monotonic() > deadline:
            log.error(
                "old fleet not released after %.0fs (running: %s, on a GPU: %s); starting anyway",
                timeout,
                sorted(waiting),
                sorted(on_gpu),
            )
            return False
        time.sleep(0.05)


def _pids_on_gpus(pids: set[int]) -> set[int]:
    """Which of `pids` NVML lists as compute processes on any GPU (empty without NVML)."""
    if not pids:
        return set()
    try:
        import pynvml
    except ImportError:
        return set()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return set()
    found: set[int] = set()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            found |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)} & pids
    except pynvml.NVMLError:
        return found
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return found
