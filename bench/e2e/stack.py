"""The parts of `python -m bench.e2e` that touch the real stack: weights, workloads, servers, worker processes,
job submission through the producer's client, and reading each job back from its Redis Stream.

Nothing here fakes a layer: Redis (or valkey) and SeaweedFS are real servers (`devstack.dev_servers`), the
workers are `ltx-worker` processes configured only through `LTX_*` variables (as an operator would), and
jobs go in through `producer.client.ProducerClient` and come back as the events clients see.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.e2e.clock import encode_window, worker_encode_stages
from devstack.dev_servers import RedisServer, S3Server, descendants, pid_alive
from ltx_contract.keys import worker_health_key
from ltx_contract.schema import RenderRequest
from ltx_contract.states import TERMINAL_STATES
from producer.client import JobEvent, ProducerClient
from producer.settings import ProducerSettings
from worker.settings import group_label

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {s.value for s in TERMINAL_STATES}
#: Stage-2 refinement with the three distilled sigmas (ltx_mgpu.runners.ltx2.denoise.STAGE2_DISTILLED_SIGMAS);
#: the two-stage runner would otherwise use its two-sigma tiled schedule on more than one rank.
STAGE2_THREE_SIGMAS = [0.909375, 0.725, 0.421875, 0.0]
#: Plain CFG, 2 passes a step: SGLang's `ltx_2_two_stage_t2v` case (LTX-2's sampling defaults there: CFG
#: 4.0 for video and audio, no STG, no modality guidance, no rescale).
CFG_ONLY = {m: {"cfg_scale": 4.0, "stg_scale": 0.0, "rescale_scale": 0.0, "modality_scale": 1.0}
            for m in ("video", "audio")}  # fmt: skip
PROMPT = "A red fox trots through fresh snow at dawn, breath steaming, the camera tracking low beside it"


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ==== weights and workloads ===============================================================================


def discover_weights(directory: Path) -> dict[str, str]:
    """Setup kwargs for the checkpoint set in `directory` (files at its top level or one folder down), found
    by content rather than by file name: the Gemma root is a folder with a gemma `config.json`; among the
    other `.safetensors` files the monolith has `model.diffusion_model.*` keys, the LoRA `lora_A`/`lora_down`
    keys, and the upsampler is the one left with a config in its metadata."""
    from safetensors import safe_open

    found: dict[str, str] = {}
    for config in sorted([directory / "config.json", *directory.glob("*/config.json")]):
        with contextlib.suppress(OSError, ValueError):
            if str(json.loads(config.read_text()).get("model_type", "")).startswith("gemma"):
                found.setdefault("gemma_root", str(config.parent))
    gemma = Path(found["gemma_root"]) if "gemma_root" in found else None
    candidates = [*directory.glob("*.safetensors"), *directory.glob("*/*.safetensors")]
    for path in sorted(p for p in candidates if gemma is None or p.parent != gemma):
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            metadata = handle.metadata() or {}
        if any("lora_A" in k or "lora_down" in k for k in keys):
            found.setdefault("distilled_lora_path", str(path))
        elif any(k.startswith("model.diffusion_model.") for k in keys):
            found.setdefault("checkpoint_path", str(path))
        elif "config" in metadata:
            found.setdefault("spatial_upsampler_path", str(path))
    missing = {"checkpoint_path", "spatial_upsampler_path", "gemma_root", "distilled_lora_path"} - set(found)
    if missing:
        raise SystemExit(f"--weights {directory}: no {sorted(missing)} found (pass --setup-json to name them)")
    return found


@dataclass(frozen=True)
class Workload:
    """One runner configuration and the request every job of a run sends."""

    runner: str  #: a name of the worker's runner registry
    variant: str  #: "default" (the runner's own defaults), or "cfg" (two-stage: CFG only, 2 passes a step)
    request: dict[str, Any]
    setup: dict[str, Any]  #: the runner's setup kwargs (LTX_RUNNER_SETUP)

    @property
    def label(self) -> str:
        return self.runner if self.variant == "default" else f"{self.runner}:{self.variant}"


def make_workload(spec: str, profile: str, weights: dict[str, str]) -> Workload:
    """`spec`: "ltx2-distilled", "ltx2-two-stage" or "ltx2-two-stage:cfg".

    full: the one-stage default request (768x512, 121 frames, 24 fps); two-stage with the reference's stage-1
    steps (40) and guidance, 3 distilled sigmas in stage 2; distilled 8 + 3. tiny: the tiny checkpoints'
    sizes (128x128, 9 frames, 2 stage-1 steps), same code path.
    """
    runner, _, variant = spec.partition(":")
    variant = variant or "default"
    if runner not in ("ltx2-distilled", "ltx2-two-stage") or variant not in ("default", "cfg"):
        raise SystemExit(f"unknown runner {spec!r}: use ltx2-distilled, ltx2-two-stage or ltx2-two-stage:cfg")
    if variant == "cfg" and runner != "ltx2-two-stage":
        raise SystemExit("the cfg variant is a two-stage one (the distilled runner has no guidance)")
    setup: dict[str, Any] = dict(weights)
    if profile == "tiny":
        request = {"prompt": PROMPT, "width": 128, "height": 128, "num_frames": 9, "frame_rate": 8.0}
        setup.update(prompt_tokens=128, default_steps=2, enhance_max_new_tokens=6, tdp_overlap=1)
    else:
        request = {"prompt": PROMPT, "width": 768, "height": 512, "num_frames": 121, "frame_rate": 24.0}
    if runner == "ltx2-distilled":
        setup.pop("distilled_lora_path", None)
    else:
        setup["stage2_sigmas"] = STAGE2_THREE_SIGMAS
        if variant == "cfg":
            setup["stage1_guidance"] = CFG_ONLY
    RenderRequest.model_validate(request)
    return Workload(runner, variant, request, setup)


# ==== servers and workers =================================================================================


class Stack:
    """Redis (AOF, fsync every second, noeviction) and SeaweedFS for the whole benchmark run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # Sessions of their own: a SIGINT to the benchmark's process group (Ctrl+C, `timeout -s INT`) must not
        # stop them before the workers, which still need them to stop cleanly.
        self.redis = RedisServer(appendonly=True, appendfsync="everysec", directory=workdir / "redis",
                                 own_session=True)  # fmt: skip
        self.s3 = S3Server(directory=workdir / "s3", own_session=True)

    def start(self) -> Stack:
        self.redis.start(timeout=30)
        self.s3.start(timeout=120)
        return self

    def producer(self, queue: str) -> ProducerClient:
        settings = ProducerSettings(redis_url=self.redis.url, queues=[queue], client="bench-e2e", max_queue_depth=0)
        return ProducerClient(settings)

    def stop(self) -> None:
        self.s3.stop()
        self.redis.stop()


@dataclass
class Workers:
    """The worker processes of one run: a supervisor (`ltx-worker --group G`) for one group, or one
    `ltx-worker one --group G` per group, each serving its own queue first and the shared one after (so
    the benchmark can give work to one fleet alone). Stopped warm (SIGTERM) with a deadline, then by pid."""

    stack: Stack
    groups: list[str]
    workload: Workload
    workdir: Path
    warmup: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    known: set[int] = field(default_factory=set)
    launched_at: float = 0.0

    @property
    def name(self) -> str:
        return f"e2e{self.run_id}"

    @property
    def queue(self) -> str:
        return f"e2e-{self.run_id}"

    def private_queue(self, group: str) -> str:
        return f"{self.queue}-{group_label(group)}"

    def env(self, queues: list[str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
        env.update(self.stack.s3.worker_env())
        env.update(
            LTX_REDIS_URL=self.stack.redis.url,
            LTX_QUEUES=",".join(queues),
            LTX_WORKER_NAME=self.name,
            LTX_RUNNER=self.workload.runner, LTX_RUNNER_SETUP=json.dumps(self.workload.setup),
            LTX_WARMUP_REQUESTS=json.dumps([self.workload.request] if self.warmup else []),
            LTX_SPOOL_DIR=str(self.workdir / "spool"),
            LTX_METRICS_PORT="0", LTX_METRICS_HOST="127.0.0.1", LTX_LOG_FORMAT="json", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.launched_at = time.time()
        python = [sys.executable, "-m", "worker"]
        if len(self.groups) == 1:
            commands = [([*python, "--group", self.groups[0]], [self.queue])]
        else:
            commands = [([*python, "one", "--group", g, "--index", str(i)], [self.private_queue(g), self.queue])
                        for i, g in enumerate(self.groups)]  # fmt: skip
        for i, (cmd, queues) in enumerate(commands):
            with (self.workdir / f"worker{i}.log").open("ab") as log:
                proc = subprocess.Popen(cmd, env=self.env(queues), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            self.procs.append(proc)

    def log_tail(self, chars: int = 4000) -> str:
        tails = []
        for log in sorted(self.workdir.glob("worker*.log")):
            with contextlib.suppress(OSError):
                tails.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(tails)

    def _check_alive(self) -> None:
        for proc in self.procs:
            self.known |= descendants(proc.pid)
            if proc.poll() is not None:
                raise RuntimeError(f"worker process exited with {proc.returncode}:\n{self.log_tail()}")

    def health(self) -> list[dict[str, Any]]:
        """Every live worker's health snapshot (from Redis)."""
        conn = self.stack.redis.client()
        try:
            out = []
            for key in conn.scan_iter(match=worker_health_key(f"{self.name}.*")):
                raw = conn.get(key)
                info = json.loads(raw) if raw else None
                if info and pid_alive(int(info["pid"])):
                    out.append(info)
            return out
        finally:
            conn.close()

    def fresh_health(self, worker: str) -> dict[str, Any]:
        """A worker's snapshot from its HTTP endpoint (current, unlike the key refreshed by heartbeats)."""
        import urllib.request

        info = next(h for h in self.health() if h["worker"] == worker)
        with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/healthz", timeout=10) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float) -> list[dict[str, Any]]:
        """Block until every group's fleet is warm (health: alive, state ready); hard deadline."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            ready = [h for h in self.health() if h["fleet"]["alive"] and h["fleet"]["state"] == "ready"]
            if len(ready) >= len(self.groups):
                return ready
            if time.monotonic() > deadline:
                raise TimeoutError(f"fleets not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def kill_rank(self, worker: str) -> tuple[int, float]:
        """SIGKILL one rank of `worker`'s fleet (the last: not the driver when there are several); returns
        (pid, wall time). Only a process this run started is ever signalled."""
        info = next(h for h in self.health() if h["worker"] == worker)
        pid = int(info["fleet"]["pids"][-1])
        self._check_alive()
        if pid not in self.known:
            raise RuntimeError(f"rank pid {pid} is not a process this benchmark started")
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return pid, at

    def stop(self, timeout: float) -> None:
        """Warm stop (SIGTERM), bounded; then SIGKILL whatever this run started and still runs."""
        for proc in self.procs:
            self.known |= descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            while proc.poll() is None and time.monotonic() < deadline:
                self.known |= descendants(proc.pid)
                time.sleep(0.1)
        for pid in sorted(self.known | {p.pid for p in self.procs}):
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


# ==== jobs ================================================================================================


def submit(client: ProducerClient, request: dict[str, Any], queue: str, n: int = 1) -> list[str]:
    """Enqueue `n` renders (seeds differ) through the producer's client; returns their ids."""
    ids = []
    for i in range(n):
        job = client.submit(RenderRequest.model_validate({**request, "seed": 1000 + i}), queue=queue)
        ids.append(job.id)
    return ids


def wait_terminal(client: ProducerClient, job_ids: list[str], timeout: float, workers: Workers) -> dict[str, str]:
    """Block until every job is terminal (uploaded, failed, cancelled); hard deadline."""
    deadline = time.monotonic() + timeout
    while True:
        states = client.peek_states(job_ids)
        if all(s in TERMINAL for s in states.values()):
            return {k: str(v) for k, v in states.items()}
        workers._check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not done after {timeout:.0f}s: {states}\n{workers.log_tail()}")
        time.sleep(0.05)


def wait_event(client: ProducerClient, job_id: str, predicate: Any, timeout: float, workers: Workers) -> JobEvent:
    deadline = time.monotonic() + timeout
    while True:
        for event in client.events(job_id):
            if predicate(event):
                return event
        workers._check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: awaited event not seen after {timeout:.0f}s\n{workers.log_tail()}")
        time.sleep(0.05)


#: The runner's stages in order, as the output event's `timings_s` names them.
STAGES = ("encode", "stage1", "upsample", "stage2", "decode", "audio_decode", "mux", "handoff")


def job_record(client: ProducerClient, job_id: str) -> dict[str, Any]:
    """What one job took, read back from its event stream and summary (the last attempt counts).

    Stage seconds come from the runner's `timings_s` (measured between device synchronisations) when the
    output event carries them, else from the gaps between its `stage` events as the worker relayed them.
    `busy`: the runner's first to output event; `gpu_window` / `gpu_busy_s`: its own device clock
    (`bench/e2e/clock.py`); `worker_encode*` / `encode_window`: the worker's mp4 encode, off the fleet.
    """
    info, events = client.status(job_id), client.events(job_id)
    starts = [i for i, e in enumerate(events) if e.type == "state" and e.data.get("state") == "started"]
    attempt = events[starts[-1]:] if starts else events  # fmt: skip
    state_ts = {e.data["state"]: float(e.data["ts"]) for e in attempt if e.type == "state"}
    runner_events = [e for e in attempt if e.type in ("stage", "progress", "output")]
    stages = [e for e in attempt if e.type == "stage"]
    output = next((e.data for e in attempt if e.type == "output"), None)
    started = attempt[0].data if starts else {}
    timings = dict((output or {}).get("timings_s") or {})
    source = "runner" if timings else "events"
    if not timings and stages and output is not None:
        ends = [float(e.data["ts"]) for e in stages[1:]] + [float(output["ts"])]
        timings = {e.data["stage"]: end - float(e.data["ts"]) for e, end in zip(stages, ends, strict=True)}
    result = info.result or {}
    submitted = info.meta.get("submitted_at")
    stage1 = next((e.data for e in stages if e.data.get("stage") == "stage1"), {})
    rendered = next((e.data for e in attempt if e.type == "state" and e.data.get("state") == "rendered"), {})
    timings.update(worker_encode_stages(rendered))
    gpu = output or {}
    return {
        "job_id": job_id,
        "state": info.state,
        "attempts": int(info.meta.get("attempt") or 0),
        "worker": started.get("worker"),
        "queue_wait_s": started.get("queue_wait_s"),
        "stages_s": {k: round(float(v), 4) for k, v in timings.items()},
        "timings_source": source,
        "render_s": (result.get("timings") or {}).get("render_s"),
        "upload_s": (result.get("timings") or {}).get("upload_s"),
        "e2e_s": rounded(state_ts["uploaded"] - float(submitted), 4) if "uploaded" in state_ts and submitted else None,
        "busy": [float(runner_events[0].data["ts"]), float(output["ts"])] if output and runner_events else None,
        **{f"{state}_at": ts for state, ts in state_ts.items()},  # started_at, rendering_at, ..., uploaded_at
        "submitted_at": submitted,
        "gpu_busy_s": gpu.get("gpu_busy_s"),
        "gpu_window": [gpu["gpu_started_at"], gpu["gpu_ended_at"]] if gpu.get("gpu_started_at") else None,
        "encode_window": encode_window(rendered),
        "peak_memory_bytes": (output or {}).get("peak_memory_bytes"),
        "passes": stage1.get("passes"),
        "video_tokens": stage1.get("video_tokens"),
        "audio": (output or {}).get("audio"),
        "bytes": result.get("size"),
        "sha256": result.get("sha256"),  #: the mp4's: equal frames and audio encode to equal files
        # what was rendered (the summary's `digests`): equal for equal requests on a deterministic fleet
        **{k: (info.meta.get("digests") or {}).get(k) for k in ("frames_sha256", "audio_sha256", "deterministic")},
        "error": info.error,
    }


# ==== GPU memory, from outside the processes =============================================================


class GpuMemory:
    """Samples `nvidia-smi` memory.used per GPU every `period` s (max kept): the whole footprint of every
    process on the GPU (contexts, NCCL buffers, the caching allocator's reserve), unlike the runner's
    allocator peaks. Does nothing where nvidia-smi is absent. Never touches CUDA itself."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.max_mib: dict[str, float] = {}
        self.binary = shutil.which("nvidia-smi")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuMemory:
        if self.binary:
            self._thread = threading.Thread(target=self._loop, name="gpu-mem", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        assert self.binary is not None
        while not self._stop.wait(self.period):
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                out = subprocess.run([self.binary, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
                for line in out.strip().splitlines():
                    index, used = (part.strip() for part in line.split(","))
                    key = f"cuda:{index}"
                    self.max_mib[key] = max(self.max_mib.get(key, 0.0), float(used))

    def take(self) -> dict[str, float] | None:
        """The maxima since the last call, in GiB (None without nvidia-smi); resets them."""
        if not self.binary:
            return None
        taken, self.max_mib = self.max_mib, {}
        return {k: round(v / 1024, 2) for k, v in sorted(taken.items())}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def hardware() -> dict[str, Any]:
    """What ran this: CPU count, GPUs (from nvidia-smi, without creating a CUDA context), versions."""
    import platform

    import torch

    gpus = None
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
            gpus = listing.strip().splitlines()
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10, check=False).stdout.strip() or None  # fmt: skip
    return {"cpus": os.cpu_count(), "gpus": gpus, "python": platform.python_version(), "torch": torch.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
