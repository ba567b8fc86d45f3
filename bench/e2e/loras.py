"""Request LoRAs on the real stack: what a job's `loras` adds to a render, side by side with jobs
without one, in one run on one fleet.

The stack is the other e2e mode's (`bench/e2e/stack.py`: Redis, SeaweedFS, one `ltx-worker` configured only
through `LTX_*` variables, jobs through the producer's client). The runner is set up with `request_loras`;
the worker gets a catalogue folder (`LTX_LORA_CATALOGUE`) holding two synthetic user LoRAs `user-a` and
`user-b` (ranks `--switch-ranks`, default 128 and 128), an allowed S3 prefix (`LTX_LORA_S3_PREFIXES`) under
which `--s3` distinct rank-128 LoRAs are uploaded (different seeds: different bytes, so none is cached), and
a cache folder of its own. The files are written and uploaded while the fleet starts. Jobs run one at a time,
all with the same request and seed, in this order (the phase of each JSON line):

    baseline x N | first_catalogue: a, b | switch: a, b, a, ... (--switches) | swap_back
    | (first_s3, swap_back) x --s3 | baseline x N

- `switch`: both LoRAs are in the worker's disk cache; each job restores the other's weights and fuses its
  own (the runner's `lora_device_cache_gib`, 4 GiB by default, keeps recent LoRAs' factors on the device, so
  a switch reads nothing; `--device-cache-gib 0` keeps only the current LoRAs' factors, and each switch
  reads its factors from the cache file). Target: adds <= 0.3 s to a render.
- `first_s3`: HEAD, parallel ranged GETs into the cache, header check, fuse. Target: adds <= 2 s (rank 128).
- `swap_back`: a job without LoRA after one with: the clean weights restored (the cost is reported), and its
  video must be the baseline's (the same frames and audio sha256, as the worker hashed them before the
  encode: `swap_back_same_video`; `baseline_deterministic` says whether the baseline jobs agree among
  themselves, without which that comparison means nothing: it needs a deterministic fleet, `--deterministic`,
  the default here; docs/producer.md "Reproducible renders").

Per job: `e2e_s` (submit to uploaded), `render_s` (the worker's fleet call), `lora_swap_s` (the runner's
`lora_swap*` timings: the ranks' header checks plus each stage's swap, between device syncs), and from the
worker's summary of the job `lora_fetch_bytes`, `lora_fetch_s` (fetch or catalogue copy, with its checks),
`lora_verify_s` (the checks alone), `lora_cached`, and `lora_direct_s` (fetch + swap: what the job's LoRA
cost directly). `SUMMARY {...}`: per phase (`phases`) the p50s and their deltas to the baseline's p50, then
`targets`: per target `adds_e2e_s` (the phase's e2e p50 minus the baseline's, measured side by side: what a
client sees, noisy by the spread of the other stages) and `adds_direct_s` (the p50 of `lora_direct_s`), each
against `target_s` (`met`, `met_direct`).

    python -m bench.e2e loras --profile tiny --groups cpu:1 --baseline 1 --switches 2 --s3 1   # what CI runs, ~40 s
    python -m bench.e2e loras --profile full --weights /dev/shm/ltx2-full --groups 0 --budget-s 190 --out X.jsonl

`--budget-s S` submits no job after S seconds (the summary counts `jobs_skipped`); a SIGINT stops the run and
still prints the summary of what ran.

Sizes at real size (`ltx_mgpu.runners.ltx2.synthetic.user_loras`): 2,304 tensors; rank 128 is 1.71 GB,
rank 32 0.43 GB. Writing a rank-128 file took 8.9 s on the 2-core CPU VM (14 s of CPU time: generating the
normal fill dominates); the bench writes on the GPU when there is one (`--write-device`). At real size the
run should take 2.5-3 minutes on one H200 (an estimate): the fleet's cold start (35-55 s) hides the five
writes and three uploads, then 19 renders of ~3.5 s and three 1.7 GB fetches.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_summary, pct, say
from bench.e2e import stack as es  # (the stack, workers and job records every e2e mode shares)
from bench.e2e.runs import cold_ready
from worker.settings import validate_group

PROG = "python -m bench.e2e loras"
PREFIX = "loras/bench"  #: under the stack's bucket; the worker allows `<bucket>/loras/`
TARGETS_S = {"switch": 0.3, "first_s3": 2.0}  #: what a phase may add to a render's e2e (docs/performance.md)


def write_loras(args: argparse.Namespace, catalogue: Path, stack: es.Stack, staging: Path) -> dict[str, Any]:
    """The two catalogue LoRAs and the S3 ones (written one at a time to `staging`, uploaded, removed)."""
    from ltx_mgpu.runners.ltx2.synthetic.user_loras import write_user_lora

    t0 = time.monotonic()
    report: dict[str, Any] = {"catalogue": [], "s3": []}
    for name, rank, seed in zip(("user-a", "user-b"), args.switch_ranks, (1, 2), strict=True):
        report["catalogue"].append(write_user_lora(args.profile, catalogue / f"{name}.safetensors", rank, seed=seed,
                                                   device=args.write_device))  # fmt: skip
    client = stack.s3.client()
    for i in range(args.s3):
        row = write_user_lora(args.profile, staging / f"s3-{i}.safetensors", args.s3_rank, seed=100 + i,
                              device=args.write_device)  # fmt: skip
        key = f"{PREFIX}/user-s3-{i}.safetensors"
        t_up = time.monotonic()
        client.upload_file(row["file"], stack.s3.bucket, key)
        Path(row["file"]).unlink()
        report["s3"].append({**row, "key": key, "upload_s": round(time.monotonic() - t_up, 3)})
    return {**report, "seconds": round(time.monotonic() - t0, 3)}


def job_plan(args: argparse.Namespace, bucket: str) -> list[tuple[str, dict[str, Any] | None]]:
    """(phase, request LoRA or None) of every job, in order (see the module docstring)."""
    strength = args.strength
    jobs: list[tuple[str, dict[str, Any] | None]] = [("baseline", None)] * args.baseline
    jobs += [("first_catalogue", {"name": n, "strength": strength}) for n in ("user-a", "user-b")]
    jobs += [("switch", {"name": ("user-a", "user-b")[i % 2], "strength": strength}) for i in range(args.switches)]
    jobs += [("swap_back", None)]
    for i in range(args.s3):
        uri = f"s3://{bucket}/{PREFIX}/user-s3-{i}.safetensors"
        jobs += [("first_s3", {"uri": uri, "strength": strength}), ("swap_back", None)]
    return jobs + [("baseline", None)] * args.baseline


def lora_fields(rec: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """What the job's LoRA cost: the fleet's swap timings, and what the worker fetched and checked."""
    used = meta.get("loras") or []
    swap = [v for k, v in rec["stages_s"].items() if k.startswith("lora_swap")]
    return {
        "lora_swap_s": round(sum(swap), 4) if swap else None,
        "lora_fetch_bytes": sum(int(u.get("fetch_bytes") or 0) for u in used),
        "lora_fetch_s": round(sum(float(u.get("fetch_s") or 0) for u in used), 4),
        "lora_verify_s": round(sum(float(u.get("verify_s") or 0) for u in used), 4),
        "lora_cached": all(u.get("cached") for u in used) if used else None,
        # what the job's LoRA cost directly: the worker's fetch (with its checks) and the fleet's swap
        "lora_direct_s": round(sum(swap) + sum(float(u.get("fetch_s") or 0) for u in used), 4) if used else None,
    }


def p50(records: list[dict[str, Any]], key: str) -> float | None:
    return es.rounded(pct([float(r[key]) for r in records if r.get(key) is not None], 50), 4)


def phase_summary(records: list[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": len(records), "failed": sum(r["state"] != "uploaded" for r in records)}
    for key in (
        "e2e_s",
        "render_s",
        "lora_swap_s",
        "lora_fetch_s",
        "lora_verify_s",
        "lora_direct_s",
        "lora_fetch_bytes",
    ):
        out[f"{key.removesuffix('_s')}_p50" + ("_s" if key.endswith("_s") else "")] = p50(records, key)
    swaps = [r["lora_swap_s"] for r in records if r.get("lora_swap_s") is not None]
    out["lora_swap_max_s"] = max(swaps) if swaps else None
    parts = {k: [r["stages_s"][k] for r in records if k in r["stages_s"]]
             for k in sorted({k for r in records for k in r["stages_s"] if k.startswith("lora_swap")})}  # fmt: skip
    out["lora_swap_parts_p50_s"] = {k: es.rounded(pct(v, 50), 4) for k, v in parts.items()}
    fetched = [r for r in records if r.get("lora_fetch_bytes")]
    if fetched:
        seconds = sum(r["lora_fetch_s"] - r["lora_verify_s"] for r in fetched)  # the transfer alone
        gb = sum(r["lora_fetch_bytes"] for r in fetched) / 1e9
        out["fetch_gb_per_s"] = round(gb / seconds, 3) if seconds > 0 else None
    if baseline is not None:
        for key in ("e2e", "render"):
            mine, base = out[f"{key}_p50_s"], baseline[f"{key}_p50_s"]
            out[f"{key}_delta_p50_s"] = es.rounded(mine - base, 4) if mine is not None and base is not None else None
    return out


def rendered(record: dict[str, Any]) -> tuple[str | None, str | None]:
    """What a job rendered, as the worker hashed it before the encode: (frames sha256, audio sha256). Videos
    are compared by these, not by the mp4's sha256: equal frames and audio are what a render promises."""
    return record.get("frames_sha256"), record.get("audio_sha256")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_phase: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_phase.setdefault(rec["phase"], []).append(rec)
    base = phase_summary(by_phase.get("baseline", []), None)
    phases = {"baseline": base, **{p: phase_summary(r, base) for p, r in by_phase.items() if p != "baseline"}}
    targets: dict[str, Any] = {}
    for phase, limit in TARGETS_S.items():
        adds = phases.get(phase, {}).get("e2e_delta_p50_s")
        direct = phases.get(phase, {}).get("lora_direct_p50_s")
        targets[phase] = {"adds_e2e_s": adds, "adds_direct_s": direct, "target_s": limit,
                          "lora_swap_p50_s": phases.get(phase, {}).get("lora_swap_p50_s"),
                          "met": None if adds is None else adds <= limit,
                          "met_direct": None if direct is None else direct <= limit}  # fmt: skip
    back = phases.get("swap_back", {})
    base_videos = {rendered(r) for r in by_phase.get("baseline", []) if r.get("frames_sha256")}
    back_videos = {rendered(r) for r in by_phase.get("swap_back", [])}
    lora_videos = {rendered(r) for r in records if r.get("lora")}
    targets["swap_back"] = {
        "adds_e2e_s": back.get("e2e_delta_p50_s"),
        "lora_swap_p50_s": back.get("lora_swap_p50_s"),
        "baseline_deterministic": len(base_videos) == 1,
        "swap_back_same_video": bool(base_videos) and back_videos <= base_videos,
        "lora_changes_video": bool(base_videos) and not lora_videos & base_videos,
    }
    return {"phases": phases, "targets": targets}


def run(args: argparse.Namespace, stack: es.Stack, workdir: Path, out: Any) -> dict[str, Any]:
    weights = es.discover_weights(args.weights) if args.weights else _tiny_weights()
    workload = es.make_workload(args.runner, args.profile, weights)
    workload.setup["request_loras"] = True
    if args.device_cache_gib is not None:  # (else the runner's default)
        workload.setup["lora_device_cache_gib"] = args.device_cache_gib
    catalogue, staging = workdir / "catalogue", workdir / "staging"
    catalogue.mkdir(parents=True)
    staging.mkdir()
    env = {"LTX_LORA_CATALOGUE": str(catalogue), "LTX_LORA_S3_PREFIXES": f"{stack.s3.bucket}/loras/",
           "LTX_LORA_CACHE_DIR": str(workdir / "lora-cache"),
           "LTX_DETERMINISTIC": "on" if args.deterministic else "off"}  # fmt: skip
    workers = es.Workers(stack, [args.groups], workload, workdir, extra_env=env)
    say("e2e", f"starting the worker ({args.runner} on {args.groups}); writing the LoRAs meanwhile")
    workers.start()
    written: dict[str, Any] = {}
    writer = threading.Thread(target=lambda: written.update(write_loras(args, catalogue, stack, staging)))
    writer.start()
    client = stack.producer(workers.queue)
    records: list[dict[str, Any]] = []
    ready: list[dict[str, Any]] = []
    plan = job_plan(args, stack.s3.bucket)
    failure = None
    try:
        ready = workers.wait_ready(args.start_timeout)
        writer.join()
        if not written:
            raise RuntimeError("writing or uploading the LoRAs failed (see the traceback above)")
        ready_s = cold_ready(workers, ready)["cold_ready_s"]
        say("e2e", f"LoRAs written in {written['seconds']} s; fleet ready: {ready_s} s")
        for phase, lora in plan:
            if args.budget_s is not None and time.monotonic() - args.t0 > args.budget_s:
                break
            request = {**workload.request, **({"loras": [lora]} if lora else {})}
            (job_id,) = es.submit(client, request, workers.queue)
            es.wait_terminal(client, [job_id], args.job_timeout, workers)
            rec = es.job_record(client, job_id)
            label = (lora or {}).get("name") or (lora or {}).get("uri")
            rec = {"kind": "job", "phase": phase, "lora": label, **lora_fields(rec, client.status(job_id).meta), **rec}
            records.append(rec)
            emit(rec, out)
    except (TimeoutError, RuntimeError, KeyboardInterrupt) as exc:  # report what ran (SIGINT: a time limit)
        failure = f"{type(exc).__name__}: {str(exc)[:2000]}"
        say("e2e", f"FAILED: {failure}")
    finally:
        client.close()
        workers.stop(args.stop_timeout)
        writer.join()
    return {"runner": workload.label, "layout": args.groups, "profile": args.profile, "request": workload.request,
            "device_cache_gib": args.device_cache_gib, "deterministic": args.deterministic,
            **(cold_ready(workers, ready) if ready else {}), "written": written, **summarize(records),
            "jobs_failed": sum(r["state"] != "uploaded" for r in records), "jobs_skipped": len(plan) - len(records),
            "failure": failure}  # fmt: skip


def _tiny_weights() -> dict[str, str]:
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2().setup_kwargs()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--weights", type=Path, default=None, help="checkpoint folder (full: required; tiny: made)")
    ap.add_argument("--runner", default="ltx2-distilled", help="ltx2-distilled (one swap a job) or ltx2-two-stage")
    ap.add_argument("--groups", default=None, help="one fleet: '0', '0,1', 'cpu:1' (default: 0 full, cpu:1 tiny)")
    ap.add_argument("--baseline", type=int, default=2, help="jobs without LoRA at the start and again at the end")
    ap.add_argument("--switches", type=int, default=6, help="jobs alternating the two cached LoRAs")
    ap.add_argument("--s3", type=int, default=3, help="distinct S3 LoRAs, each used once")
    ap.add_argument("--switch-ranks", default="128,128", help="ranks of the catalogue LoRAs user-a,user-b")
    ap.add_argument("--s3-rank", type=int, default=128)
    ap.add_argument("--strength", type=float, default=0.8)
    ap.add_argument("--device-cache-gib", type=float, default=None,
                    help="runner setup lora_device_cache_gib (default: the runner's, 4 GiB)")  # fmt: skip
    ap.add_argument("--write-device", default=None, help="where the LoRAs are generated (default: cuda if any)")
    ap.add_argument("--start-timeout", type=float, default=None, help="s for the fleet to be warm")
    ap.add_argument("--job-timeout", type=float, default=None, help="s per job")
    ap.add_argument("--stop-timeout", type=float, default=120.0)
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="the worker's LTX_DETERMINISTIC on (default: equal requests, equal frames)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=None, help="submit no job after this many s (then report)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    ap.add_argument("--workdir", type=Path, default=None, help="logs, LoRAs, servers' data (default: a temp dir)")
    args = ap.parse_args(argv)
    args.t0 = time.monotonic()
    full = args.profile == "full"
    if full and args.weights is None:
        ap.error("--profile full needs --weights DIR")
    args.groups = validate_group(args.groups or ("0" if full else "cpu:1"))
    args.switch_ranks = [int(r) for r in args.switch_ranks.split(",")]
    if len(args.switch_ranks) != 2:
        ap.error("--switch-ranks takes two ranks, e.g. 128,32")
    if args.write_device is None:
        import torch

        args.write_device = "cuda" if torch.cuda.is_available() else "cpu"
    args.start_timeout = args.start_timeout or (900.0 if full else 300.0)
    args.job_timeout = args.job_timeout or (600.0 if full else 300.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ltx-loras-"))
    out = args.out.open("w") if args.out else None
    stack = es.Stack(workdir).start()
    try:
        summary = run(args, stack, workdir, out)
    finally:
        stack.stop()
        for big in ("catalogue", "staging", "lora-cache", "s3/data"):  # GBs at real size; the logs stay
            shutil.rmtree(workdir / big, ignore_errors=True)
    failure = summary["failure"]
    summary.update(hardware=es.hardware(), wall_s=round(time.monotonic() - args.t0, 1),
                   synthetic_weights=args.profile == "full")  # fmt: skip
    emit_summary(summary, out)
    if out is not None:
        out.close()
    if args.workdir is None and failure is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif failure:
        say("e2e", f"logs kept in {workdir}")
    return 1 if failure or summary["jobs_failed"] else 0
