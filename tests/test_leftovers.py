"""Nothing left behind (once, after the suite and the demo, /dev/shm/sem.mp-* semaphores and
/tmp/pymp-* directories remained).

Where they came from: each controller channel carried a `multiprocessing` lock, a named POSIX semaphore in
/dev/shm that only its creator's exit handlers (or, once every process holding it is gone, the resource
tracker) remove, so a SIGKILLed worker whose tracker was killed too left them for good; and a rank that
shares a yielded tensor by file descriptor makes a `pymp-*` directory for it, which a rank that is killed
or leaves through `os._exit` never removes. Now the channels need no cross-process lock, and the ranks'
temporary files live in a scratch directory the controller removes (the ranks' watchdog does, if the
controller was killed).

Each scenario runs in child processes with a private TMPDIR and a `sitecustomize` that records every named
semaphore they create (tests/leakcheck), and lists both before and after.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, enqueue, pid_alive, wait_ready, wait_state, worker_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)

_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from ltx_mgpu import MGPUController, MGPURunner

    class Sharing(MGPURunner):
        def setup(self):
            pass

        def __call__(self, mode="yield", x=None):
            yield torch.full((4,), float(self.rank))  # a shared tensor: a pymp dir in the sending rank
            if mode == "die" and self.rank == 1:
                os._exit(3)

    if __name__ == "__main__":
        scenario = sys.argv[1]
        ctl = MGPUController(Sharing, devices=["cpu", "cpu"])
        ctl.start(timeout=120)
        print("ranks", *ctl.pids, flush=True)
        list(ctl.stream())
        if scenario == "clean":
            list(ctl.stream(x=torch.ones(3)))
            ctl.shutdown(graceful_timeout=10)
        elif scenario == "rank_dies":
            try:
                list(ctl.stream(mode="die"))
            except Exception as exc:
                print("failed as planned:", type(exc).__name__, flush=True)
            os.kill(ctl.pids[0], signal.SIGKILL)
            ctl.shutdown(graceful_timeout=10)
        elif scenario == "owner_killed":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.fixture
def private_tmp():
    """A short private TMPDIR (unix socket paths below it are capped at 108 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="lk-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(tmp: Path, private: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(private), "LTX_LEAKCHECK_LOG": str(tmp / "sems.log"),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "leakcheck"), str(ROOT)])}  # fmt: skip


def _left(tmp: Path, private: Path) -> tuple[list[str], list[str], list[str]]:
    """(named semaphores created, those still in /dev/shm, files left in the private TMPDIR)."""
    log = tmp / "sems.log"
    created = [line.split()[1] for line in log.read_text().splitlines()] if log.exists() else []
    alive = [n for n in created if Path("/dev/shm/sem." + n.lstrip("/")).exists()]
    # (torch's compile cache is a cache, meant to outlive a process; anything else must go)
    files = sorted(p.name for p in private.iterdir() if p.name != "torchinductor_root")
    return created, alive, files


@pytest.mark.parametrize("scenario", ["clean", "rank_dies", "owner_killed"])
def test_a_controller_leaves_no_semaphore_and_no_temporary_directory(
    tmp_path: Path, private_tmp: Path, scenario: str
) -> None:
    script = tmp_path / "leak.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), scenario], env=_env(tmp_path, private_tmp), capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip
    ranks = [int(p) for line in proc.stdout.splitlines() if line.startswith("ranks") for p in line.split()[1:]]
    assert len(ranks) == 2, proc.stdout + proc.stderr
    if scenario == "owner_killed":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 0, proc.stderr
    wait_for(lambda: not any(pid_alive(p) for p in ranks), 30, "the ranks to exit")
    created, alive, files = _left(tmp_path, private_tmp)
    assert created == [], f"named semaphores created: {created} (still in /dev/shm: {alive})"
    assert files == [], f"left in TMPDIR after the {scenario} run: {files}"


def test_a_worker_stopped_after_a_job_leaves_nothing(
    tmp_path: Path, private_tmp: Path, redis_server, s3_server
) -> None:
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"lk{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=tmp_path / "spool")
    extra = _env(tmp_path, private_tmp)
    env.update({k: v for k, v in extra.items() if k in ("TMPDIR", "LTX_LEAKCHECK_LOG", "PYTHONPATH")})
    proc = WorkerProcess(["one", "--group", "cpu:2"], env, tmp_path / "worker.log").start()
    conn = redis_server.client()
    try:
        (info,) = wait_ready(conn, name, 1, 120, proc)
        job = enqueue(conn, queue, {"prompt": "t", "width": 64, "height": 64, "num_frames": 9})
        assert wait_state(job, {"uploaded", "failed"}, 60, proc) == "uploaded"
    finally:
        assert proc.stop(60) == 0, proc.log_tail()
        conn.close()
    wait_for(lambda: not any(pid_alive(p) for p in info["fleet"]["pids"]), 30, "the ranks to exit")
    created, alive, files = _left(tmp_path, private_tmp)
    assert created == [] and alive == [], created
    assert files == [], files
