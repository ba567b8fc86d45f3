"""The memory plan against the GPU: one fleet renders each size and prints, per stage, the plan's predicted
reserved peak against the allocator's measured one (`torch.cuda.max_memory_reserved`, reset at every stage
start by the runner's stage clock, the worst rank: `peak_reserved_bytes` of the output event; the allocated
peak, `peak_memory_bytes`, beside it): the plan must predict what the allocator reserves (docs/memory.md).

    python -m bench.plan_check --weights /dev/shm/ltx2-full --runner ltx2-two-stage:cfg --devices 0 \\
        --sizes 1536x1024x121,1536x1024x241
    python -m bench.plan_check --weights /dev/shm/ltx2-full --runner ltx2-distilled --devices 0   # the presets
    python -m bench.plan_check --tiny --devices cpu,cpu --sizes 128x128x9      # a check of the script (no peaks)
    python -m bench.plan_check --weights DIR --runner ltx2-distilled --quantization fp8-mm+attn --devices 0
    python -m bench.plan_check --weights DIR --runner ltx2-distilled --quantization fp8-mm+attn --devices 0 \
        --offered-gib 40 --sizes 768x512x121                   # a 48 GB card emulated (allocator capped at 40)
    python -m bench.plan_check --weights DIR --runner ltx2-two-stage:cfg --quantization fp8-mm+attn --devices 0 \
        --sizes 1536x1024x121 --variants      # every plan that fits, side by side: is the order the fastest?

The fleet is placed as the worker places it (`ltx_mgpu.spec.placement.choose` for the local card and the host
memory it may pin, `--host-gib`; `--placement JSON` fixes it): the placement and each rank's resident set as
measured after setup (`setup_memory_gib`, per part) are printed beside the plan's resident figures.

Each size is planned as the worker plans a job (`ltx_mgpu.spec.memory_plan.plan` on the runner's `memory_fleet`, the
capacity the last render measured, `device_memory_bytes`, else the device's free + reserved memory now), and
rendered with that plan's `memory_plan` kwarg; a size the plan refuses is reported with its reason and not
rendered. One render per size (the first of a size captures its CUDA graphs, which is what a job of a new
size does too); `--warm` renders each size twice and reports the second. A size that runs out of memory is
reported (`oom`) and the next size runs on the same fleet. Prints one JSON line per stage and size, then
`SUMMARY {...}` with the worst relative error of the reserved peak over the rendered sizes and `admitted_oom`,
the sizes the plan admitted that ran out of memory (each one a bug of the plan).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_summary
from bench.stages import REQUEST, RUNNERS, setup_kwargs

GIB = float(1 << 30)
PLAN_STAGES = ("encode", "stage1", "upsample", "stage2", "decode")


def render(ctl: Any, out: Path, request: dict[str, Any], memory_plan: dict[str, Any]) -> dict[str, Any]:
    """One render; its output event plus `wall_s` (raises what the fleet raises)."""
    t0 = time.perf_counter()
    output: dict[str, Any] = {}
    for event in ctl.stream(**request, seed=1, memory_plan=memory_plan, output_path=str(out / "v.mp4")):
        if isinstance(event, dict) and event.get("type") == "output":
            output = event
    return {**output, "wall_s": round(time.perf_counter() - t0, 3)}


def stage_rows(size: str, planned: Any, output: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against measured per plan stage (GiB, the worst rank of each)."""
    reserved = output.get("peak_reserved_bytes") or {}
    allocated = output.get("peak_memory_bytes") or {}
    rows = []
    for peak in planned.stages:
        measured = max(reserved.get(peak.stage) or [0]) / GIB
        row = {"event": "stage", "size": size, "stage": peak.stage, "predicted_reserved_gib": peak.reserved_gib,
               "measured_reserved_gib": round(measured, 2), "predicted_allocated_gib": peak.allocated_gib,
               "measured_allocated_gib": round(max(allocated.get(peak.stage) or [0]) / GIB, 2),
               "seconds": (output.get("timings_s") or {}).get(peak.stage)}  # fmt: skip
        if measured:
            row["error"] = round(peak.reserved_gib / measured - 1.0, 4)  # + over-predicts, - under-predicts
        rows.append(row)
    return rows


def capacity_gib(output: dict[str, Any] | None, ctl: Any) -> float | None:
    """What a device offers the fleet's rank, as the worker plans with it: the last render's measurement, else
    what the ranks reported after setup (never this process's view: the ranks' weights are not in its allocator)."""
    if output and output.get("device_memory_bytes"):
        return round(float(output["device_memory_bytes"]) / GIB, 2)
    measured = getattr(getattr(ctl, "startup", None), "device_memory_bytes", None)
    return None if measured is None else round(float(measured) / GIB, 2)


def _variant_name(planned: Any) -> str:
    decode = "chunked" if planned.decode_chunked else "whole"
    return f"decode {decode}, gemma {'parked' if planned.park_text_encoder else 'resident'}"


def compare_variants(ctl: Any, out: Path, request: dict[str, Any], fleet: Any, chosen: Any, first: dict) -> int:
    """Render `request` with every plan variant that fits in memory, twice each (the second counts: a parked
    Gemma drops the CUDA graphs every job, so its second render pays the recapture a steady stream pays), the
    chosen plan again last, and emit each one's wall and stage seconds beside the chosen one's. Returns how many
    variants the plan said fit that ran out of memory."""
    from ltx_mgpu import SymmetricRunnerError
    from ltx_mgpu.spec import memory_plan

    fitting = [v for v in memory_plan.variants(fleet, *chosen.size, frame_rate=chosen.frame_rate)
               if v.limit_gib is None or v.peak.reserved_gib <= v.limit_gib]  # fmt: skip
    tried = [v for v in fitting if v.job_kwargs() != chosen.job_kwargs()]
    size, oom, walls = "x".join(map(str, chosen.size)), 0, {}
    for variant in [*tried, chosen]:
        try:
            output = [render(ctl, out, request, variant.job_kwargs()) for _ in range(2)][-1]
        except SymmetricRunnerError as exc:
            oom += bool(exc.out_of_memory)
            emit({"event": "variant_failed", "size": size, "variant": _variant_name(variant),
                  "out_of_memory": exc.out_of_memory, "message": str(exc)[:300]})  # fmt: skip
            continue
        walls[_variant_name(variant)] = output["wall_s"]
        measured = max((max(v) for v in (output.get("peak_reserved_bytes") or {}).values()), default=0)
        emit({"event": "variant", "size": size, "variant": _variant_name(variant), "chosen": variant is chosen,
              "wall_s": output["wall_s"], "timings_s": output.get("timings_s"),
              "predicted_peak_gib": variant.peak.reserved_gib,
              "measured_peak_gib": round(measured / GIB, 2)})  # fmt: skip
    base = walls.get(_variant_name(chosen))
    if base is not None:
        emit({"event": "variants", "size": size, "chosen": _variant_name(chosen), "first_render_s": first["wall_s"],
              "wall_s": walls, "wall_over_chosen": {k: round(v / base, 3) if base > 0 else None
                                                    for k, v in walls.items()}})  # fmt: skip
    return oom


def place(kind: str, devices: list[Any], setup: dict[str, Any], sizes: list, args: Any) -> dict[str, str]:
    """The placement the worker would choose for this fleet on the local card (or `--placement`)."""
    import json

    from ltx_mgpu.runners.ltx2 import spec
    from ltx_mgpu.spec import placement as pl

    if args.placement != "auto":
        return spec.placement({"placement": json.loads(args.placement)})
    from worker.render.fleet_plan import local_card

    found = local_card([f"cuda:{d}" for d in devices if d != "cpu"])
    if args.card:
        found = (pl.CARDS[args.card], pl.CARDS[args.card].offered_gib)
    if args.offered_gib:  # (a smaller card: the local one's link, or an H100's off a GPU)
        link = (found[0] if found else pl.CARDS["h100-80gb"]).h2d_gbps
        found = (pl.Card(f"{args.offered_gib:g}GiB", args.offered_gib, link, "--offered-gib"), args.offered_gib)
    if found is None:
        return spec.placement({})
    fleet = spec.memory_fleet(kind, len(devices), setup)
    host = args.host_gib
    if host is None:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable")) / 2**20
        host = max(0.0, available - 8.0)
    best, judged = pl.choose(fleet, found[0], host_gib=host, sizes=sizes[:1])
    emit({"event": "placement", "card": found[0].describe(), "host_gib": round(host, 1),
          "judged": [{**c.placement, "host_gib": c.host_gib, "seconds": c.seconds, "problem": c.problem}
                     for c in judged]})  # fmt: skip
    return (best or judged[0]).placement


def main() -> None:
    from ltx_mgpu.spec.request_rules import PRESETS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=None, help="the checkpoint folder (synthetic's layout)")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoints instead of --weights")
    ap.add_argument("--runner", default="ltx2-two-stage:cfg", help="ltx2-distilled, ltx2-two-stage[:cfg]")
    ap.add_argument("--devices", default="0", help="comma list of GPU indices (one fleet)")
    ap.add_argument("--sizes", default=",".join(PRESETS), help="comma list of WxHxF (default: the presets)")
    ap.add_argument("--frame-rate", type=float, default=24.0)
    ap.add_argument("--headroom-gib", type=float, default=4.0)
    ap.add_argument("--warm", action="store_true", help="render each size twice, report the second")
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also render every other plan the size fits in (fast / chunked decode, Gemma parked or not), twice "
        "each, and print their seconds beside the chosen one's: what the plan's order assumes, measured",
    )
    ap.add_argument("--quantization", default=None, help="the runners' setup quantization (fp8-mm, fp8-mm+attn)")
    ap.add_argument("--placement", default="auto", help="auto (as the worker chooses) or a JSON placement")
    ap.add_argument("--host-gib", type=float, default=None, help="pinned host memory the fleet may take (auto)")
    ap.add_argument(
        "--card",
        default=None,
        help="plan for this card (h100-80gb, h200) instead of the local one; "
        "with LTX_MGPU_MEMORY_CAP_GIB its offered memory caps the ranks' allocators (an emulation)",
    )
    ap.add_argument(
        "--offered-gib",
        type=float,
        default=None,
        help="plan for a card offering this many GiB a rank, and cap the ranks' allocators there "
        "(LTX_MGPU_MEMORY_CAP_GIB, unless set): a 48 GB card emulated as 40",
    )
    args = ap.parse_args()
    import os

    import torch

    from ltx_mgpu import MGPUController, SymmetricRunnerError
    from ltx_mgpu.runners.ltx2 import runners as ltx2
    from ltx_mgpu.runners.ltx2 import spec
    from ltx_mgpu.spec import memory_plan
    from ltx_mgpu.spec import placement as pl

    if (args.weights is None) != args.tiny:
        raise SystemExit("give --weights DIR or --tiny")
    name, setup = setup_kwargs(args.runner, args.weights)
    if args.quantization:
        setup["quantization"] = args.quantization
    sizes = [memory_plan.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    devices: list[Any] = [d if d == "cpu" else int(d) for d in args.devices.split(",")]
    kind = spec.RUNNER_KINDS[f"ltx_mgpu.runners.ltx2.runners:{RUNNERS[name]}"]
    setup["placement"] = place(kind, devices, setup, sizes, args)
    if args.offered_gib:
        from ltx_mgpu.runners.common.stages import MEMORY_CAP_ENV

        os.environ.setdefault(MEMORY_CAP_ENV, f"{args.offered_gib:g}")  # (the ranks inherit it)
    ctl = MGPUController(getattr(ltx2, RUNNERS[name]), devices=devices)
    t0 = time.perf_counter()
    ctl.start(timeout=900, **setup)
    plan_resident = memory_plan.plan(spec.memory_fleet(kind, len(devices), setup), *sizes[0]).resident_gib
    emit({"event": "started", "start_s": round(time.perf_counter() - t0, 1), "placement": setup["placement"],
          "measured_setup_gib": [r.setup_memory_gib for r in ctl.startup.ranks],
          "planned_resident_gib": plan_resident})  # fmt: skip
    errors: list[float] = []
    done: list[dict[str, Any]] = []
    admitted_oom = variant_oom = 0
    last: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for w, h, f in sizes:
                size = f"{w}x{h}x{f}"
                fleet = spec.memory_fleet(kind, len(devices), setup)
                capacity = capacity_gib(last, ctl)
                if args.card:  # (the emulated card's figure, not the device's)
                    capacity = min(capacity or 1e9, pl.CARDS[args.card].offered_gib)
                if args.offered_gib:
                    capacity = min(capacity or 1e9, args.offered_gib)
                fleet = memory_plan.FleetMemory(**{**fleet.to_json(), "capacity_gib": capacity,
                                               "headroom_gib": args.headroom_gib})  # fmt: skip
                planned = memory_plan.plan(fleet, w, h, f, frame_rate=args.frame_rate)
                if not planned.fits:
                    emit({"event": "refused", "size": size, "reason": planned.refusal(),
                          "largest": memory_plan.largest(fleet, w, h, f, frame_rate=args.frame_rate)})  # fmt: skip
                    done.append({"size": size, "result": "refused"})
                    continue
                request = {**REQUEST, "width": w, "height": h, "num_frames": f, "frame_rate": args.frame_rate}
                try:
                    for _ in range(2 if args.warm else 1):
                        output = render(ctl, Path(tmp), request, planned.job_kwargs())
                except SymmetricRunnerError as exc:
                    result = "oom" if exc.out_of_memory else "error"
                    admitted_oom += result == "oom"
                    emit({"event": result, "size": size, "message": str(exc)[:400],
                                      "predicted_peak_gib": planned.peak.reserved_gib})  # fmt: skip
                    done.append({"size": size, "result": result})
                    continue
                last = output
                if args.variants:
                    variant_oom += compare_variants(ctl, Path(tmp), request, fleet, planned, output)
                for row in stage_rows(size, planned, output):
                    emit(row)
                    if "error" in row:
                        errors.append(row["error"])
                measured = max((max(v) for v in (output.get("peak_reserved_bytes") or {}).values()), default=0)
                done.append({"size": size, "result": "rendered", "wall_s": output["wall_s"],
                             "low_memory": planned.low_memory, "predicted_peak_gib": planned.peak.reserved_gib,
                             "measured_peak_gib": round(measured / GIB, 2)})  # fmt: skip
        finally:
            ctl.shutdown(graceful_timeout=60)
    summary = {"runner": args.runner, "devices": devices, "sizes": done, "frame_rate": args.frame_rate,
               "worst_error": max(errors, key=abs) if errors else None, "admitted_oom": admitted_oom,
               "variant_oom": variant_oom,
               "placement": setup["placement"], "quantization": args.quantization,
               "gpu": "cpu" if devices[0] == "cpu" else torch.cuda.get_device_name(devices[0]),
               "torch": torch.__version__}  # fmt: skip
    emit_summary(summary)


if __name__ == "__main__":
    main()
