"""The chaos soak: several seeds of `tests/chaos` runs, each on a fresh stack (Redis with AOF, a worker
supervisor with cpu:2 + cpu:1 groups; one SeaweedFS shared by all seeds), many jobs and faults per seed.

Prints one JSON line per event and per seed, then the total report line:
`faults N, survived N, jobs M, lost 0, duplicated 0, corrupt 0, leaked processes 0, bad inputs K rejected K`.
Exit code 0 only if every invariant held and every fault was survived.

    .venv/bin/python bench/chaos.py --seeds 1,2,3,4 --jobs 55 --faults 14 --bad-inputs 30
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chaos.engine import Report, run_chaos
from worker.devservers import S3Server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4", help="comma-separated seeds (one fresh stack each)")
    ap.add_argument("--jobs", type=int, default=55, help="jobs per seed")
    ap.add_argument("--faults", type=int, default=14, help="faults per seed")
    ap.add_argument("--bad-inputs", type=int, default=30, help="generated bad requests per seed")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--verbose", action="store_true", help="print every fault event")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    total = Report(seed=-1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ltx-chaos-"))

    def log(event: dict[str, object]) -> None:
        if args.verbose:
            print(json.dumps(event, default=str), flush=True)

    with S3Server() as s3:
        for seed in seeds:
            report, verdict = run_chaos(workdir, seed=seed, jobs=args.jobs, faults=args.faults,
                                        bad_inputs=args.bad_inputs, s3=s3, hard_redis=True, log=log)  # fmt: skip
            details = {k: v for k, v in report.details.items() if k != "log_tail" or not report.ok}
            print(json.dumps({"seed": seed, "ok": report.ok, "seconds": report.seconds, "line": report.line(),
                              "unexpected": verdict.unexpected, **details}, default=str), flush=True)  # fmt: skip
            for name in ("faults", "survived", "jobs", "lost", "duplicated", "corrupt", "leaked", "bad_inputs",
                         "rejected", "seconds"):  # fmt: skip
                setattr(total, name, getattr(total, name) + getattr(report, name))
            total.details.setdefault("failed_seeds", [])
            if not report.ok:
                total.details["failed_seeds"].append(seed)
    print(
        json.dumps({"seeds": seeds, "seconds": round(total.seconds, 1), "failed_seeds": total.details["failed_seeds"]})
    )
    print(total.line())
    return 0 if not total.details["failed_seeds"] else 1


if __name__ == "__main__":
    sys.exit(main())
