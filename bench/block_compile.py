"""One LTX-2 transformer block eager against `torch.compile`d (inductor), bf16 and fp8, side by side in one run.

Why: at 6,144 and 24,576 video tokens a 19B block spends 21-30% of its device time in unfused elementwise
kernels (the modulated RMS norms, RoPE, gates and residual adds: `bench/fp8.py --kernels`), more than the
FP8 GEMMs save. Inductor fuses those into a few Triton kernels. This measures what that buys per block,
what it costs to compile (first shape, then a second shape with `dynamic=True`: a service sees request
sizes it has not compiled for), and how far the compiled block's output is from the eager one.

Each call is replayed from a CUDA graph after warm-up, as the runners run their denoising forwards.
Output: JSON lines, then one line starting with "SUMMARY" with compiled/eager speed-ups.

    python bench/block_compile.py --tokens 6144,24576          # one H200
    python bench/block_compile.py --device cpu --dims tiny --tokens 96 --iters 1 --warmup 0 --weights bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8 import _Case, _graph, _outputs, _rel, kernel_profile
from sp_block import DIMS, _time


def _bound(block: Any, *args: Any) -> Any:
    """`block` called with `args`, as a no-argument callable (what `_graph` and `_time` take)."""
    return lambda: block(*args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dims", choices=sorted(DIMS), default="19b")
    ap.add_argument("--tokens", default="6144,24576")
    ap.add_argument("--weights", default="bf16,fp8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    ap.add_argument("--kernels", type=int, default=0, metavar="N", help="profile the compiled block too")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    case = _Case("ltx", DIMS[args.dims], device)
    print(json.dumps({"kind": "env", "torch": torch.__version__, "dims": args.dims, "mode": args.mode,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}),
          flush=True)  # fmt: skip
    blocks = {"bf16": case.bf16, "fp8": case.fp8}
    compiled = {name: torch.compile(blocks[name], dynamic=True, mode=args.mode) for name in args.weights.split(",")}
    summary: list[str] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        vargs, aargs, pert = case.ltx_args(tokens)
        for name, cblock in compiled.items():
            eager, ccall = (_bound(b, vargs, aargs, pert) for b in (blocks[name], cblock))
            with torch.no_grad():
                t0 = time.perf_counter()
                out_c = _outputs(ccall())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                compile_s = time.perf_counter() - t0
                out_e = _outputs(eager())
                run_e = _graph(eager, device)[0]
                run_c = _graph(ccall, device)[0]
                eager_ms = _time(run_e, device, args.iters, args.warmup)
                comp_ms = _time(run_c, device, args.iters, args.warmup)
                eager_ms2 = _time(run_e, device, args.iters, args.warmup)  # again: the machine is noisy
            row = {"kind": "block", "weights": name, "video_tokens": tokens, "first_call_s": round(compile_s, 2),
                   "eager_ms": round(min(eager_ms, eager_ms2), 3), "compiled_ms": round(comp_ms, 3),
                   "speedup": round(min(eager_ms, eager_ms2) / comp_ms, 3),
                   "rel_diff_video": _rel(out_c[0], out_e[0]), "rel_diff_audio": _rel(out_c[1], out_e[1])}  # fmt: skip
            print(json.dumps(row), flush=True)
            summary.append(f"{tokens} {name}: {row['speedup']}x (first call {row['first_call_s']} s)")
            if args.kernels and device.type == "cuda":
                with torch.no_grad():
                    prof = kernel_profile(ccall, args.kernels)
                print(json.dumps({"kind": "kernels", "video_tokens": tokens, "weights": name, "compiled": True,
                                  **prof}), flush=True)  # fmt: skip
            del run_e, run_c
    print("SUMMARY compiled/eager block | " + " | ".join(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
