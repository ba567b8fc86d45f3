"""`ChaosRunner`: the smoke runner plus an execution log and faults that need the runner's cooperation.

The worker resolves it by name (`LTX_RUNNERS={"chaos": "tests.chaos.runner:ChaosRunner"}`). Requests are
validated by the real `RenderRequest` (unknown fields rejected), so faults are steered through the prompt:
space-separated `key=value` directives, e.g. "a fox fault=kill_rank at=1 hold_s=0.5".

| directive   | effect                                                                             |
|-------------|------------------------------------------------------------------------------------|
| fault=kill_rank | the last rank SIGKILLs itself at denoising step `at` (default 1)               |
| fault=hang  | the last rank sleeps for an hour at step `at`: the fleet's render timeout fires     |
| fault=raise | the last rank raises RunnerError after its last step (asymmetric when world > 1)    |
| hold_s=F    | every rank sleeps F seconds per step (keeps a job mid-render for external faults)  |

Faults fire only on a job's first execution (rank 0 counts earlier `start` records and broadcasts the
attempt number), so a retried job can succeed and the fault counts as survived.

Execution log: one append-only JSON Lines file per job, `<exec_log_dir>/<job id>.jsonl`. Every rank
appends `{"event": "start", "job", "attempt", "rank", "world", "pid", "t"}` when the render begins; the
driver appends `{"event": "end", ...}` after the mp4 is written; the raising rank appends
`{"event": "fault", "kind": "raise", ...}` right before it raises. The invariant checker reads it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ltx_mgpu import RunnerError
from ltx_mgpu.runners.smoke.runner import SmokeRunner

__all__ = ["ChaosRunner", "directives", "read_exec_log"]

RUNNER_NAME = "chaos"
RUNNER_PATH = "tests.chaos.runner:ChaosRunner"


def directives(prompt: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in prompt.split() if "=" in part)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One small O_APPEND write per record (atomic on a local file system), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_exec_log(directory: Path, job_id: str) -> list[dict[str, Any]]:
    path = Path(directory) / f"{job_id}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


class ChaosRunner(SmokeRunner):
    """See the module docstring."""

    def setup(self, *, exec_log_dir: str, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.exec_log_dir = Path(exec_log_dir)
        self.exec_log_dir.mkdir(parents=True, exist_ok=True)
        self._fault: tuple[str, int] | None = None
        self._hold_s = 0.0
        self._step = 0

    def _attempt(self, log: Path) -> int:
        """Rank 0 counts earlier starts; every rank learns the same number (a collective on every rank)."""
        import torch.distributed as dist

        count = [0]
        if self.is_driver and log.exists():
            count[0] = sum(1 for r in read_exec_log(log.parent, log.stem) if r["event"] == "start" and r["rank"] == 0)
        if self.world_size > 1:
            dist.broadcast_object_list(count, src=0, group=self.groups.control_group)
        return int(count[0]) + 1

    def raise_if_cancelled(self) -> None:
        """Called once per denoising step on every rank by the smoke pipeline: the fault hook."""
        self._step += 1
        if self._hold_s:
            time.sleep(self._hold_s)
        fault = self._fault
        if fault is not None and self.rank == self.world_size - 1 and self._step == fault[1]:
            kind = fault[0]
            if kind == "kill_rank":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(3600)
        super().raise_if_cancelled()

    def __call__(self, *, output_path: str, prompt: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        d = directives(prompt)
        job = Path(output_path).parent.name
        log = self.exec_log_dir / f"{job}.jsonl"
        attempt = self._attempt(log)
        base = {"job": job, "attempt": attempt, "rank": self.rank, "world": self.world_size, "pid": os.getpid()}
        append_record(log, {"event": "start", **base, "t": time.time()})
        fault = d.get("fault")
        self._fault = (fault, int(d.get("at", 1))) if fault and attempt == 1 else None
        self._hold_s = float(d.get("hold_s", 0))
        self._step = 0
        raise_at_end = self._fault is not None and self._fault[0] == "raise" and self.rank == self.world_size - 1
        try:
            yield from super().__call__(output_path=output_path, prompt=prompt, **kwargs)
        finally:
            self._fault = None
            self._hold_s = 0.0
        if raise_at_end:
            # After the last collective: the other ranks finish normally, so the controller sees one rank
            # raise and the others not (a RunnerError raised *inside* a collective leaves the others blocked
            # in it until the render timeout poisons the fleet, which is the `hang` fault's path). The log
            # says it fired: if this attempt is lost before (its worker killed by another fault), the retry
            # renders without the fault and the job rightly ends uploaded (the checker reads this record).
            append_record(log, {"event": "fault", "kind": "raise", **base, "t": time.time()})
            raise RunnerError(f"injected fault on rank {self.rank} only")
        if self.is_driver:
            append_record(log, {"event": "end", **base, "t": time.time()})
