"""The worker-test support's old path, kept so branches that import it still work: everything now lives in
`tests.support.runners` (the fault-injection runners), `tests.support.workers` (worker processes, jobs) and
`tests.support.wait` (`wait_for`). New code imports from there. No test functions here."""

from tests.support.runners import (
    RUNNERS,
    BrokenSetupRunner,
    FaultRunner,
    directives,
    noise_frames,
    output_bytes,
    read_records,
)
from tests.support.wait import wait_for
from tests.support.workers import (
    ROOT,
    SMALL_REQUEST,
    LaunchedWorker,
    WorkerProcess,
    enqueue,
    events,
    launch_worker,
    meta_state,
    pid_alive,
    wait_ready,
    wait_rq_status,
    wait_state,
    worker_env,
    worker_health,
)

__all__ = [
    "ROOT", "RUNNERS", "SMALL_REQUEST", "BrokenSetupRunner", "FaultRunner", "LaunchedWorker", "WorkerProcess",
    "directives", "enqueue", "events", "launch_worker", "meta_state", "noise_frames", "output_bytes", "pid_alive",
    "read_records", "wait_for", "wait_ready", "wait_rq_status", "wait_state", "worker_env", "worker_health",
]  # fmt: skip
