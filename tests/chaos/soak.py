"""The chaos soak (`python -m tests.chaos.soak`; it lives beside its engine because no package, bench/
included, imports tests): several seeds of `tests/chaos` runs, each on a fresh stack (Redis with AOF, a worker
supervisor with cpu:2 + cpu:1 groups; one SeaweedFS shared by all seeds), many jobs and faults per seed.

Prints one JSON line per seed (and per event with --verbose), then the total report line:
`faults N, survived N, jobs M, unexpected 0, lost 0, duplicated 0, corrupt 0, leaked processes 0, bad inputs
K rejected K, stalled 0`. Exit code 0 only if every seed held every invariant, every job ended as its fault
(or none) predicts, every fault was survived and no step stalled; 1 otherwise.

Heavy load (one loss was once seen at load average 30-90 on two cores, and never with two burners):
`--burners N` runs N CPU burners (`python -c 'while 1: pass'`, started and stopped by pid) beside the soak;
`--io-burners N` runs N writers that fsync a 64 KiB file in a loop (Redis fsyncs every write: disk contention
is load too); `--nice K` lowers every process of the stack (Redis, supervisor, workers, ranks) to niceness K,
so the burners win the CPU; `--burner-nice B` lowers the burners too (a shared machine: other users keep
most of their share while the stack, at K > B, still gets the scraps). No cgroups needed. E.g.
`--burners 32 --nice 10` keeps a two-core machine at a load average above 30 with the service starved.

Every lost, duplicated, corrupt or unexpected job leaves an evidence folder (tests/chaos/evidence.py: its
events, hash, registries, the faults around it, the worker log); the seed's line names it and the last line
lists them all.

`--plant retry0` is the negative control of the checker: every retry budget is set to 0, so fault jobs that
should survive a retry end `failed` and the soak must exit 1. `--plant lost` is the evidence's: one job is
taken out of its queue, so the soak must exit 1 naming that job's evidence folder.

    .venv/bin/python -m tests.chaos.soak --seeds 31,32,33,34 --jobs 50 --faults 14 --burners 32 --nice 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from devstack.dev_servers import S3Server
from tests.chaos.engine import Report, run_chaos

PLANTS = {
    "retry0": {f"retry_{r}": 0 for r in ("fleet_failure", "worker_lost", "upload_failed", "worker_shutdown")},
    "lost": {},
}  # ("lost" is planted by the engine, not through worker settings)

_IO_BURNER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
block = os.urandom(65536)
while True:
    os.pwrite(fd, block, 0)
    os.fsync(fd)
"""


@contextlib.contextmanager
def burners(count: int, io_count: int = 0, io_dir: Path | None = None, nice: int = 0) -> Iterator[list[int]]:
    """`count` busy-looping processes and `io_count` fsync loops (each on its own file in `io_dir`), at
    niceness `nice`, beside the soak; stopped by pid (never by name) at the end."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    procs += [subprocess.Popen([sys.executable, "-c", _IO_BURNER, str(Path(io_dir or ".") / f"io-burner-{i}")])
              for i in range(io_count)]  # fmt: skip
    for p in procs:
        if nice:
            os.setpriority(os.PRIO_PROCESS, p.pid, nice)
    if io_dir is not None:  # (so whoever must stop a soak killed before its cleanup knows exactly which pids)
        (Path(io_dir) / "burners.pids").write_text("".join(f"{p.pid}\n" for p in procs))
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4", help="comma-separated seeds (one fresh stack each)")
    ap.add_argument("--jobs", type=int, default=55, help="jobs per seed")
    ap.add_argument("--faults", type=int, default=14, help="faults per seed")
    ap.add_argument("--bad-inputs", type=int, default=30, help="generated bad requests per seed")
    ap.add_argument("--burners", "--burner", dest="burners", type=int, default=0,
                    help="CPU burner processes beside the soak")  # fmt: skip
    ap.add_argument("--io-burners", type=int, default=0, help="fsync-loop writer processes beside the soak")
    ap.add_argument("--nice", type=int, default=0, help="niceness of every process of the stack (0-19)")
    ap.add_argument("--burner-nice", type=int, default=0,
                    help="niceness of the burners (on a shared machine: below --nice, so the stack still starves "
                         "while other users' processes keep most of their share)")  # fmt: skip
    ap.add_argument("--render-timeout", type=float, default=12.0,
                    help="the fleet's render timeout (heavy load: raise it, or starved fault-free renders time out "
                         "and fail like the hang fault's)")  # fmt: skip
    ap.add_argument(
        "--settle-timeout",
        type=float,
        default=240.0,
        help="how long to wait for every job to end before checking (what has not ended is lost)",
    )
    ap.add_argument("--plant", choices=sorted(PLANTS), default=None, help="negative control: plant a defect")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--verbose", action="store_true", help="print every fault event")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    total = Report(seed=-1)
    failed_seeds: list[int] = []
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ltx-chaos-"))
    overrides = (PLANTS[args.plant] or None) if args.plant else None
    plant = "lost" if args.plant == "lost" else None
    evidence: list[str] = []

    def log(event: dict[str, object]) -> None:
        if args.verbose:
            print(json.dumps(event, default=str), flush=True)

    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    with S3Server() as s3, burners(args.burners, args.io_burners, workdir, args.burner_nice) as burner_pids:
        load = os.getloadavg()
        for seed in seeds:
            report, _verdict = run_chaos(workdir, seed=seed, jobs=args.jobs, faults=args.faults,
                                        bad_inputs=args.bad_inputs, s3=s3, hard_redis=True,
                                        worker_settings=overrides, plant=plant, nice=args.nice,
                                        render_timeout=args.render_timeout, settle_timeout=args.settle_timeout,
                                        log=log)  # fmt: skip
            details = {k: v for k, v in report.details.items() if k != "log_tail" or not report.ok}
            print(json.dumps({"seed": seed, "ok": report.ok, "seconds": report.seconds, "line": report.line(),
                              "load_avg": os.getloadavg(), **details}, default=str), flush=True)  # fmt: skip
            total.add(report)
            if report.details.get("evidence"):
                evidence.append(report.details["evidence"]["folder"])
            if not report.ok:
                failed_seeds.append(seed)
    print(json.dumps({"seeds": seeds, "seconds": round(time.monotonic() - t0, 1), "failed_seeds": failed_seeds,
                      "burners": len(burner_pids), "nice": args.nice, "load_avg_at_start": load,
                      "load_avg_at_end": os.getloadavg(), "plant": args.plant, "evidence": evidence}))  # fmt: skip
    print(total.line() + (f"; evidence in {', '.join(evidence)}" if evidence else ""))
    return 1 if failed_seeds else 0


if __name__ == "__main__":
    sys.exit(main())
