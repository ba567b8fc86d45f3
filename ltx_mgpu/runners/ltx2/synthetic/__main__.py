"""`python -m ltx_mgpu.runners.ltx2.synthetic --profile full|tiny --out DIR ...` (see the package docstring)."""

from __future__ import annotations

import argparse

import torch

from . import COMPONENTS, PROFILES, plan_files, print_json, write_checkpoints


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ltx_mgpu.runners.ltx2.synthetic",
        description="Write a synthetic LTX-2 checkpoint set (real layouts, seeded random weights: renders are "
        "noise, timings and memory are real).",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--out", required=True, help="output directory (e.g. /dev/shm/ltx2-full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where tensors are generated"
    )
    parser.add_argument(
        "--components", default=",".join(COMPONENTS), help=f"comma-separated subset of {','.join(COMPONENTS)}"
    )
    parser.add_argument("--plan", action="store_true", help="print each file's size and tensor count; write nothing")
    args = parser.parse_args(argv)
    components = [c.strip() for c in args.components.split(",") if c.strip()]
    if args.plan:
        for plan in plan_files(args.profile, components):
            print_json(
                {
                    "event": "plan",
                    "file": plan.relpath,
                    "component": plan.component,
                    "tensors": len(plan.specs),
                    "bytes": plan.nbytes,
                }
            )
        return
    write_checkpoints(
        args.profile, args.out, seed=args.seed, device=args.device, components=components, report=print_json
    )


if __name__ == "__main__":
    main()
