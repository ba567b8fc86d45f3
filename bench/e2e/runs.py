"""The whole service end to end at real size: cold start, warm latency, throughput, GPU idle, memory, rebuild.

For each run (a runner on a layout of device groups) it starts `ltx-worker` on the real stack (Redis with
AOF, SeaweedFS, the worker configured only through `LTX_*` variables, as an operator would), submits
through the producer's Python client and reads every job back from its Redis Stream and summary:

- per job (one JSON line each): queue wait, text encode, stage 1, upsample, stage 2, video decode, audio
  decode, mux (the runner's `timings_s`, measured between device syncs; from its stage events where the
  runner does not report them), upload, end to end (submit to `uploaded`);
- per run: cold ready (launch to every fleet warm, split into process start / weight load / warm-up from
  the worker's health snapshot: the warm-up is the workload request itself, `LTX_WARMUP_REQUESTS`), warm
  end-to-end p50/p90 (jobs one at a time), videos per hour under a backlog (all jobs queued at once),
  the fleet's GPU-busy ratio under that backlog (the runner's device-busy seconds, measured between device
  syncs, over the span from the first job's first device work to the last job's last) and its idle between
  jobs (per fleet: the last device work of one job to the first of the next; `event_gap_*` is the old,
  looser figure: output event to the next job's first event, blind to an encode on the fleet; and
  `fleet_idle_parts_p50_ms` cuts the gap at the output event, the next job's start and its `rendering`), whether
  a job's denoising slows while the worker encodes the previous video beside it (`denoise_beside_encode`:
  stage 1 + upsample + stage 2 of the backlog jobs whose device window covers at least half of an encode,
  p50, over the same of the jobs run one at a time), peak memory
  per GPU (the runner's allocator peaks per rank, and `nvidia-smi` memory.used of
  the whole GPU), and rebuild after a rank is SIGKILLed mid-job (seconds until a job renders again, and
  what happened to the killed job);
- with two or more groups, a backlog on one fleet alone first (each worker serves its own queue first),
  then on all of them: the throughput ratio is measured side by side in the same run.

The final line is `SUMMARY {...}`: the first run's fields at the top level, every run under `runs`, and
the cross-run ratios. Workloads (see `bench/e2e/stack.py:make_workload`): the one-stage default request
(LTX-2's one-stage CLI and SGLang's sampling default), 768x512, 121 frames, 24 fps, or `--size WxHxF`
(repeatable: every run at every size; the two-stage and distilled CLIs default to 1536x1024);
`ltx2-two-stage` with the reference's stage-1 steps and guidance (4 passes a step) and 3 distilled sigmas
in stage 2; `ltx2-two-stage:cfg` the same with plain CFG (2 passes a step: the work of SGLang's published
2xH100 figure, whose LTX-2 sampling defaults are CFG 4.0 with no STG and no modality guidance);
`ltx2-distilled` 8 + 3. Synthetic weights (`--weights`, made by `python -m ltx_mgpu.runners.ltx2.synthetic`)
render noise: their timings and memory are real.

    python -m bench.e2e runs --profile tiny --groups cpu:2 --jobs 3               # CPU, what CI runs
    python -m bench.e2e runs --profile full --weights /dev/shm/ltx2 --plan gpu2 --only 0,1,2 --out $OUT/e2e-a.jsonl
    python -m bench.e2e runs --profile full --weights DIR --runner ltx2-distilled --groups 0,1 --groups '0;1'
    python -m bench.e2e runs --profile full --weights DIR --plan sizes-gpu1 --out $OUT/e2e-sizes.jsonl

`--encode worker` (default): the worker encodes, fed while the fleet decodes; `fleet`: the driver rank before
the fleet is free; `once`: the worker, fed after the decode; `both` / `stream-vs-once`: each run twice, then
`ratios`. `--vae-chunk-frames N`: temporal decode chunks, so the streamed encode starts on the first one.
`--deterministic [on|strict|both]` / `--no-deterministic`: `LTX_DETERMINISTIC`; `both`: each run on, then off.

Every wait has a hard deadline; `--budget-s` skips the runs (in plan order, most important first) that
would start after it is spent, and the summary lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_summary, pct, say
from bench.e2e.clock import denoise_beside_encode, gpu_busy_ratio, idle_gaps_ms, idle_parts_ms
from bench.e2e.plans import PLANS, RunSpec, determinism_cost, parse_size, refusal, sized, with_determinism
from bench.e2e.stack import (
    STAGES,
    GpuMemory,
    Stack,
    Workers,
    Workload,
    discover_weights,
    hardware,
    job_record,
    make_workload,
    rounded,
    submit,
    wait_event,
    wait_terminal,
)
from ltx_mgpu.runners.ltx2.spec import QUANTIZATIONS  # (stdlib only: the setup's names)
from worker.settings import validate_group

PROG = "python -m bench.e2e runs"
GIB = 1024**3


def cold_ready(workers: Workers, ready: list[dict[str, Any]]) -> dict[str, Any]:
    """Launch → every fleet warm, split by the slowest fleet at each point (the phases then add up)."""
    starts = [h["fleet"]["startup"] or {} for h in ready]
    if not all(starts):
        return {"cold_ready_s": None}
    t0 = workers.launched_at
    loading = max(s["started_at"] + s.get("process_start_s", 0.0) for s in starts)
    loaded = max(s.get("loaded_at", loading) for s in starts)
    ready_at = max(s["ready_at"] for s in starts)
    return {
        "cold_ready_s": round(ready_at - t0, 3),
        "cold_ready": {
            "process_start_s": round(loading - t0, 3),  # launch, worker process, ranks, process groups
            "weight_load_s": round(loaded - loading, 3),  # the runners' setup(): model load
            "warmup_s": round(ready_at - loaded, 3),  # the warm-up render (the first job's extra work)
            "worker_process_s": round(max(h["process_started_at"] for h in ready) - t0, 3),
        },
        "cold_ready_ranks": [rank_split(s) for s in starts],
    }


def rank_split(start: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank of one fleet: interpreter and imports, process groups, then each timed part of setup()."""
    out = []
    for r in start.get("ranks", []):
        out.append({
            "rank": r["rank"],
            "boot_s": round(r["booted_at"] - start["started_at"], 3),
            "groups_s": round(r["setup_began_at"] - r["booted_at"], 3),
            "setup_s": round(r["ready_at"] - r["setup_began_at"], 3),
            "setup_phases_s": r.get("setup_phases_s", {}),
        })  # fmt: skip
    return out


def backlog(client: Any, workers: Workers, workload: Workload, n: int, queue: str, args: Any, phase: str,
            out: Any) -> dict[str, Any]:  # fmt: skip
    """Queue `n` jobs at once; throughput from the first submit to the last upload, idle gaps per fleet."""
    fleets = len(workers.groups) if queue == workers.queue else 1
    t0 = time.time()
    ids = submit(client, workload.request, queue, n)
    wait_terminal(client, ids, args.job_timeout * math.ceil(n / fleets) + 60, workers)
    records = [job_record(client, job_id) for job_id in ids]
    for rec in records:
        emit({"kind": "job", "phase": phase, "runner": workload.label, "layout": ";".join(workers.groups), **rec}, out)
    done = [r["uploaded_at"] for r in records if r["state"] == "uploaded" and "uploaded_at" in r]
    gaps, idle = idle_gaps_ms(records), idle_gaps_ms(records, "gpu_window")
    return {
        "jobs": n,
        "failed": sum(r["state"] != "uploaded" for r in records),
        "videos_per_hour": round(3600 * len(done) / (max(done) - t0), 2) if done else None,
        "gpu_busy_ratio": gpu_busy_ratio(records),
        "fleet_idle_p50_ms": rounded(pct(idle, 50), 2),
        "fleet_idle_p90_ms": rounded(pct(idle, 90), 2),
        "fleet_idle_max_ms": rounded(max(idle), 2) if idle else None,
        "fleet_idle_parts_p50_ms": idle_parts_ms(records),
        "event_gap_p50_ms": rounded(pct(gaps, 50), 2),
        "event_gap_p90_ms": rounded(pct(gaps, 90), 2),
        "records": records,
    }


def rebuild(client: Any, workers: Workers, workload: Workload, args: Any, out: Any) -> dict[str, Any]:
    """Kill a rank while stage 1 runs; seconds until a job renders again, and the killed job's fate."""
    (job_id,) = submit(client, workload.request, workers.queue)
    wait_event(client, job_id, lambda e: e.type == "stage" and e.data.get("stage") == "stage1", args.job_timeout,
               workers)  # fmt: skip
    worker = next(e.data["worker"] for e in client.events(job_id) if e.data.get("state") == "started")
    pid, killed_at = workers.kill_rank(worker)
    say("e2e", f"killed rank pid {pid} of {worker} during stage 1 of {job_id}")
    wait_terminal(client, [job_id], args.start_timeout + args.job_timeout * 2, workers)
    killed = job_record(client, job_id)
    emit({"kind": "job", "phase": "rebuild", "runner": workload.label, "layout": ";".join(workers.groups), **killed},
         out)  # fmt: skip
    events = client.events(job_id)
    retried = next((e.data for e in events if e.data.get("state") == "retrying"), None)
    again = [float(e.data["ts"]) for e in events if e.data.get("state") == "rendering" and e.data["ts"] > killed_at]
    if not again:  # not retried (budget 0): the next job is the one to wait for
        (nxt,) = submit(client, workload.request, workers.queue)
        wait_terminal(client, [nxt], args.start_timeout + args.job_timeout, workers)
        again = [job_record(client, nxt).get("rendering_at")]
    fresh = workers.fresh_health(worker)
    return {
        "rebuild_s": round(again[0] - killed_at, 3) if again and again[0] else None,
        "rebuild": {
            "killed_pid": pid,
            "fleet_startup": fresh["fleet"].get("startup"),
            "rebuilds": fresh["fleet"].get("rebuilds"),
        },
        "killed_job": {
            "state": killed["state"],
            "attempts": killed["attempts"],
            "first_failure": (retried or {}).get("error", killed.get("error")),
        },
    }


def stage_p50(records: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for stage in [*STAGES, *sorted({k for r in records for k in r["stages_s"]} - set(STAGES))]:
        values = [r["stages_s"][stage] for r in records if stage in r["stages_s"]]
        if values:
            out[stage] = rounded(pct(values, 50), 4)
    for key in ("queue_wait_s", "upload_s", "e2e_s"):
        values = [float(r[key]) for r in records if r.get(key) is not None]
        out[key.removesuffix("_s")] = rounded(pct(values, 50), 4)
    return out


def peak_memory(records: list[dict[str, Any]], devices_of: dict[str, list[str]]) -> dict[str, float] | None:
    """The runner's allocator peak per GPU (max over stages and jobs), GiB; None on CPU fleets."""
    peaks: dict[str, int] = {}
    for rec in records:
        per_stage = rec.get("peak_memory_bytes")
        devices = devices_of.get(rec.get("worker") or "")
        if not per_stage or not devices:
            continue
        for ranks in per_stage.values():
            for device, value in zip(devices, ranks, strict=False):
                peaks[device] = max(peaks.get(device, 0), int(value))
    return {d: round(v / GIB, 2) for d, v in sorted(peaks.items())} or None


def run(stack: Stack, spec: RunSpec, args: Any, weights: dict[str, str], workdir: Path, gpu: GpuMemory,
        out: Any) -> dict[str, Any]:  # fmt: skip
    chunks = {"vae_chunk_frames": int(args.vae_chunk_frames)} if args.vae_chunk_frames else {}
    workload = sized(make_workload(spec.runner, args.profile, {**weights, "quantization": args.quantization, **chunks}),
                     spec.size)  # fmt: skip
    extra = dict(item.split("=", 1) for item in args.worker_env or ())
    workers = Workers(stack, list(spec.groups), workload, workdir, warmup=not args.no_warmup,
                      extra_env={**spec.worker_env(), **extra})  # fmt: skip
    summary: dict[str, Any] = {
        "kind": "run",
        "profile": args.profile,
        "runner": workload.runner,
        "variant": workload.variant,
        "layout": spec.layout,
        "encode": spec.encode,
        "deterministic": spec.deterministic,  # (None: the worker's default, `auto`)
        "request": workload.request,
        "size": spec.size,
    }
    if args.profile == "full" and (refused := refusal(workload, [len(g.split(",")) for g in spec.groups])):
        say("e2e", f"run {spec.label}: refused by the memory plan: {refused}")
        return {**summary, "refused": refused}
    say("e2e", f"run {spec.label}: starting workers")
    gpu.take()
    workers.start()
    client = stack.producer(workers.queue)
    try:
        ready = workers.wait_ready(args.start_timeout)
        summary.update(cold_ready(workers, ready))
        summary["world_sizes"] = [len(h["fleet"]["devices"]) for h in ready]
        devices_of = {h["worker"]: h["fleet"]["devices"] for h in ready}
        say("e2e", f"ready in {summary['cold_ready_s']}s: {summary.get('cold_ready')}")
        warm: list[dict[str, Any]] = []
        for _ in range(spec.warm):
            (job_id,) = submit(client, workload.request, workers.queue)
            wait_terminal(client, [job_id], args.job_timeout, workers)
            rec = job_record(client, job_id)
            warm.append(rec)
            emit({"kind": "job", "phase": "warm", "runner": workload.label, "layout": spec.layout, **rec}, out)
        e2e = [r["e2e_s"] for r in warm if r["e2e_s"] is not None]
        summary.update(e2e_p50_s=rounded(pct(e2e, 50)), e2e_p90_s=rounded(pct(e2e, 90)), warm_jobs=len(warm),
                       warm_failed=sum(r["state"] != "uploaded" for r in warm))  # fmt: skip
        records = list(warm)
        if spec.backlog and len(spec.groups) > 1:
            say("e2e", f"backlog of {spec.backlog} on one fleet alone ({spec.groups[0]})")
            alone = backlog(client, workers, workload, spec.backlog, workers.private_queue(spec.groups[0]), args,
                            "backlog_alone", out)  # fmt: skip
            records += alone.pop("records")
            summary["alone"] = alone
        if spec.backlog:
            say("e2e", f"backlog of {spec.backlog} on {len(spec.groups)} fleet(s)")
            both = backlog(client, workers, workload, spec.backlog, workers.queue, args, "backlog", out)
            summary["denoise_beside_encode"] = denoise_beside_encode(warm, both["records"])
            records += both.pop("records")
            summary.update({k: both[k] for k in ("videos_per_hour", "gpu_busy_ratio", "fleet_idle_p50_ms",
                                                 "fleet_idle_p90_ms", "event_gap_p50_ms")}, backlog=both)  # fmt: skip
            if "alone" in summary and summary["alone"]["videos_per_hour"] and both["videos_per_hour"]:
                summary["throughput_ratio_to_one_fleet"] = round(
                    both["videos_per_hour"] / summary["alone"]["videos_per_hour"], 3
                )
        summary["stages_p50_s"] = stage_p50(warm or records)
        summary["passes_per_step"] = next((r["passes"] for r in records if r.get("passes")), None)
        summary["peak_mem_gib"] = peak_memory(records, devices_of)
        if spec.rebuild:
            say("e2e", "rebuild: killing a rank mid-job")
            summary.update(rebuild(client, workers, workload, args, out))
        summary["gpu_mem_used_max_gib"] = gpu.take()
    finally:
        client.close()
        workers.stop(args.stop_timeout)
    for key in ("e2e_p50_s", "e2e_p90_s", "videos_per_hour", "gpu_busy_ratio", "fleet_idle_p50_ms", "rebuild_s"):
        summary.setdefault(key, None)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--weights", type=Path, default=None, help="checkpoint folder (full: required; tiny: made)")
    ap.add_argument("--setup-json", type=Path, default=None, help="runner setup kwargs naming the files instead")
    ap.add_argument("--plan", choices=sorted(PLANS), default=None, help="a preset list of runs (overrides below)")
    ap.add_argument("--only", default=None, help="with --plan: run only these plan indices, e.g. 0,1,2")
    ap.add_argument("--runner", action="append", default=None, help="repeatable; default ltx2-distilled")
    ap.add_argument("--groups", action="append", default=None,
                    help="a layout, repeatable: '0,1' one fleet of two, '0;1' two fleets, 'cpu:2'")  # fmt: skip
    ap.add_argument("--size", action="append", default=None, type=_size,
                    help="WxHxF of the request, repeatable (default: the workload's, 768x512x121)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=5, help="warm jobs and backlog jobs per run (default 5)")
    ap.add_argument("--warm", type=int, default=None, help="warm jobs per run (default --jobs)")
    ap.add_argument("--backlog", type=int, default=None, help="backlog jobs per run (default --jobs)")
    ap.add_argument("--no-rebuild", action="store_true", help="skip the rank-kill phase")
    ap.add_argument("--vae-chunk-frames", type=int, default=0, help="the runner's vae_chunk_frames (0: one piece)")
    ap.add_argument("--encode", choices=("worker", "fleet", "both", "once", "stream-vs-once"), default="worker",
                    help="who encodes the mp4: the worker beside the next job, the fleet (old), or both")  # fmt: skip
    ap.add_argument("--deterministic", nargs="?", const="on", choices=("on", "strict", "both"), default=None,
                    help="workers' LTX_DETERMINISTIC; 'both': each run on, then off")  # fmt: skip
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_const", const="off")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up request at fleet start")
    ap.add_argument("--start-timeout", type=float, default=None, help="s for every fleet to be warm")
    ap.add_argument("--job-timeout", type=float, default=None, help="s per job")
    ap.add_argument("--stop-timeout", type=float, default=120.0)
    ap.add_argument("--budget-s", type=float, default=None, help="skip runs that would start after this")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="fp8-mm (linears), fp8-mm+attn (and attention): docs/runners.md")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    ap.add_argument("--workdir", type=Path, default=None, help="logs and spool (default: a temp dir)")
    ap.add_argument("--worker-env", action="append", default=None, metavar="LTX_NAME=VALUE",
                    help="a worker setting for every run (repeatable), e.g. LTX_HOST_MEMORY_GIB=66")  # fmt: skip
    args = ap.parse_args(argv)
    if any("=" not in item or not item.startswith("LTX_") for item in args.worker_env or ()):
        ap.error("--worker-env takes LTX_NAME=VALUE")
    full = args.profile == "full"
    args.start_timeout = args.start_timeout or (900.0 if full else 300.0)
    args.job_timeout = args.job_timeout or (600.0 if full else 300.0)
    if full and args.weights is None and args.setup_json is None:
        ap.error("--profile full needs --weights DIR (or --setup-json)")
    return args


def _size(text: str) -> str:
    try:
        return "x".join(str(n) for n in parse_size(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def specs_from(args: argparse.Namespace) -> list[RunSpec]:
    specs = _specs(args)
    if args.encode == "worker":
        return specs
    if args.encode in ("fleet", "once"):
        return [dataclasses.replace(s, encode=args.encode) for s in specs]
    other = "once" if args.encode == "stream-vs-once" else "fleet"
    return [v for s in specs for v in (s, dataclasses.replace(s, encode=other))]


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    if args.plan:
        plan = PLANS[args.plan]
        if args.only is None:
            return plan
        return [plan[int(i)] for i in args.only.split(",") if i.strip()]
    warm = args.jobs if args.warm is None else args.warm
    back = args.jobs if args.backlog is None else args.backlog
    specs = []
    for runner in args.runner or ["ltx2-distilled"]:
        for layout in args.groups or ["cpu:2"]:
            groups = tuple(validate_group(g) for g in layout.split(";") if g.strip())
            for size in args.size or [None]:
                specs.append(RunSpec(runner, groups, warm, back, rebuild=not args.no_rebuild, size=size))
    return specs


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cross-run ratios measured in this run: one fleet of N GPUs against one GPU, per runner."""
    out: dict[str, Any] = {}
    for other, what in (("fleet", "worker encode vs fleet encode"), ("once", "streamed vs one hand-off")):
        before = {(r["runner"], r["variant"], r["layout"], r.get("size")): r for r in runs if r.get("encode") == other}
        for r in runs:
            old = before.get((r["runner"], r["variant"], r["layout"], r.get("size")))
            if r.get("encode") == "worker" and old is not None:
                name = f"{r['runner']}:{r['variant']} {r['layout']}{' ' + r['size'] if r.get('size') else ''} {what}"
                for key in ("e2e_p50_s", "videos_per_hour", "gpu_busy_ratio"):
                    if r.get(key) and old.get(key):
                        out[f"{name}: {key}"] = round(r[key] / old[key], 3)
    for r in runs:
        if (ratio := r.get("throughput_ratio_to_one_fleet")) is not None:
            out[f"{r['runner']}:{r['variant']} {r['layout']} throughput vs one fleet alone"] = ratio
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = with_determinism(specs_from(args), args.deterministic)
    if args.setup_json:
        weights = json.loads(args.setup_json.read_text())
    elif args.weights:
        weights = discover_weights(args.weights)
    else:
        from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

        weights = ensure_tiny_ltx2().setup_kwargs()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ltx-e2e-"))
    out = args.out.open("w") if args.out else None
    t0 = time.monotonic()
    stack = Stack(workdir).start()
    gpu = GpuMemory().start()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    failures: list[str] = []
    try:
        for i, spec in enumerate(specs):
            label = spec.label
            if args.budget_s is not None and time.monotonic() - t0 > args.budget_s:
                skipped.append(label)
                continue
            try:
                summary = run(stack, spec, args, weights, workdir / f"run{i}", gpu, out)
            except (TimeoutError, RuntimeError) as exc:
                failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:2000]}")
                say("e2e", f"run {label} FAILED: {exc}")
                continue
            except KeyboardInterrupt:  # SIGINT (e.g. a time limit): its workers are stopped; report what ran
                failures.append(f"{label}: interrupted")
                skipped += [s.label for s in specs[i + 1 :]]
                break
            runs.append(summary)
            emit(summary, out)
        final: dict[str, Any] = {**(runs[0] if runs else {"profile": args.profile}), "quantization": args.quantization}
        final.pop("kind", None)
        final.update(runs=runs, ratios={**ratios(runs), **determinism_cost(runs)}, skipped=skipped,
                     failures=failures, hardware=hardware(), wall_s=round(time.monotonic() - t0, 1),
                     synthetic_weights=args.profile == "full")  # fmt: skip
        emit_summary(final, out)
    finally:
        gpu.stop()
        stack.stop()
        if out is not None:
            out.close()
    if args.workdir is None and not failures:
        shutil.rmtree(workdir, ignore_errors=True)  # servers' data, spool, logs (kept when a run failed)
    elif failures:
        say("e2e", f"logs kept in {workdir}")
    return 1 if failures or not runs else 0
