"""One LTX-2 fleet under `MGPUController`, no service around it: the per-stage timings (`timings_s` of the
runner's output event) and the wall time of warm renders of the one-stage default request (768x512, 121
frames, 24 fps). What `python -m bench.e2e runs`'s stage table reports, without Redis, S3 or the worker, so a
before/after of the runner itself fits one short GPU call (no server wheels to carry).

    python -m bench.stages --weights /dev/shm/ltx2-full --runner ltx2-two-stage:cfg --devices 0 --jobs 3
    python -m bench.stages --tiny --devices cpu,cpu --jobs 1      # the tiny checkpoints: a check of the script
    python -m bench.stages --weights /dev/shm/ltx2-full --runner ltx2-distilled --quantization fp8-mm

`ltx2-two-stage:cfg`: plain CFG 4.0, 2 passes a step, and the three distilled stage-2 sigmas (the e2e
benchmark's workload of the same name); `ltx2-two-stage`: the runner's defaults; `ltx2-distilled`. The first
render after the start is the warm-up (graph captures) and is reported apart. Prints JSON lines, then
`SUMMARY {...}` with the p50 of every stage.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_summary
from ltx_mgpu.runners.ltx2.spec import QUANTIZATIONS  # (stdlib only: the setup's names)

RUNNERS = {"ltx2-distilled": "Ltx2DistilledRunner", "ltx2-two-stage": "Ltx2TwoStageRunner"}
PROMPT = "A red fox trots through fresh snow at dawn, breath steaming, the camera tracking low beside it"
REQUEST = {"width": 768, "height": 512, "num_frames": 121, "frame_rate": 24.0, "prompt": PROMPT}


def setup_kwargs(spec: str, weights: Path | None) -> tuple[str, dict[str, Any]]:
    from ltx_mgpu.runners.ltx2.synthetic import Ltx2Files
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    runner, _, variant = spec.partition(":")
    files = ensure_tiny_ltx2() if weights is None else Ltx2Files.under(weights)
    setup: dict[str, Any] = dict(files.setup_kwargs())
    if weights is None:  # the tiny checkpoints' sizes (bench/e2e/stack.py's tiny profile)
        setup.update(prompt_tokens=128, default_steps=2, enhance_max_new_tokens=6, tdp_overlap=1)
        REQUEST.update(width=128, height=128, num_frames=9, frame_rate=8.0)
    if runner == "ltx2-distilled":
        setup.pop("distilled_lora_path", None)
    else:
        setup["stage2_sigmas"] = [0.909375, 0.725, 0.421875, 0.0]
    if variant == "cfg":
        plain = {"cfg_scale": 4.0, "stg_scale": 0.0, "rescale_scale": 0.0, "modality_scale": 1.0}
        setup["stage1_guidance"] = {"video": plain, "audio": plain}
    return runner, setup


def render(ctl: Any, out: Path, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    output: dict[str, Any] = {}
    for event in ctl.stream(**REQUEST, seed=seed, output_path=str(out / f"{seed}.mp4")):
        if isinstance(event, dict) and event.get("type") == "output":
            output = event
    return {"wall_s": round(time.perf_counter() - t0, 3), **{k: round(v, 3) for k, v in output["timings_s"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=None, help="the checkpoint folder (synthetic's layout)")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoints instead of --weights")
    ap.add_argument("--runner", default="ltx2-two-stage:cfg")
    ap.add_argument("--devices", default="0", help="comma list of GPU indices (one fleet)")
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="fp8-mm (linears), fp8-mm+attn (and attention): docs/runners.md")  # fmt: skip
    args = ap.parse_args()
    import torch

    from ltx_mgpu import MGPUController
    from ltx_mgpu.runners.ltx2 import runners as ltx2

    if (args.weights is None) != args.tiny:
        raise SystemExit("give --weights DIR or --tiny")
    name, setup = setup_kwargs(args.runner, args.weights)
    if args.quantization:
        setup["quantization"] = args.quantization
    devices: list[Any] = [d if d == "cpu" else int(d) for d in args.devices.split(",")]
    ctl = MGPUController(getattr(ltx2, RUNNERS[name]), devices=devices)
    t0 = time.perf_counter()
    ctl.start(timeout=900, **setup)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            start_s = round(time.perf_counter() - t0, 1)
            emit({"event": "started", "start_s": start_s})
            warm = render(ctl, Path(tmp), 0)
            emit({"event": "warmup", **warm})
            for seed in range(1, args.jobs + 1):
                rows.append(render(ctl, Path(tmp), seed))
                emit({"event": "job", **rows[-1]})
        finally:
            ctl.shutdown(graceful_timeout=60)
    p50 = {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in rows[0]}
    summary = {"runner": args.runner, "quantization": args.quantization, "devices": devices, "jobs": len(rows),
               "start_s": start_s, "p50": p50,
               "gpu": "cpu" if devices[0] == "cpu" else torch.cuda.get_device_name(devices[0]),
               "torch": torch.__version__}  # fmt: skip
    emit_summary(summary)


if __name__ == "__main__":
    main()
