"""Per-stage wall time and peak accelerator memory of one job, for the driver's `output` event.

`StageClock.stage(name)` brackets a stage: the device is synchronised before and after (so the seconds are
the stage's own work, not queued kernels of the previous one or launches still running) and, on CUDA, the
peak-memory counter is reset at the start and read at the end. `timings_s` is the driver's view (wall
seconds per stage); `peak_report()` gathers every rank's peaks (a collective over the control group).

Stage names used by the runners (the `output` event's `timings_s` keys): `encode`, `stage1`, `upsample`,
`stage2` (ltx2) or `denoise` (smoke), `decode` (video), `audio_decode`, `mux` (the runner writes the mp4) or
`handoff` (yuv420p conversion on the device and the copy out: the worker encodes), and `lora_swap_stage1` /
`lora_swap_stage2` where a runner fuses LoRAs per stage, plus `lora_swap_check` (the request LoRAs' header
checks, host only, timed before the clock starts and added after `reset()`), and `unpark` where a job parked
the text encoder (its CUDA graphs dropped and the encoder's copy back started: `Ltx2Resident._unpark_text`).
A stage a runner does not have, or skipped for this job (no audio asked), is absent.

The honest clock: `gpu_report()` gives the job's device-busy seconds (every stage but the
CPU-only `mux`) and the wall-clock window from the start of its first stage to the end of its last device
stage, so a service can measure fleet idle from the last device work of one job to the first of the next
instead of from event gaps (which hid a whole mp4 encode per video). On CUDA it also gives
`device_memory_bytes`: what the driver's device offers this rank (`determinism.offered_memory_bytes`: the
device's total memory under deterministic algorithms, the default, else free + this allocator's reservation),
the capacity the worker's memory plan (`ltx_mgpu.spec.memory_plan`) checks requests against after its warm-up.

Fault injection (tests, and the GPU check of docs/memory.md): with `LTX_MGPU_INJECT_OOM` naming a file, a
stage whose name is a line of that file raises `torch.OutOfMemoryError` as it starts, on every rank that runs
it (read at each stage start, so a test changes the file between jobs of one fleet).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ...control.determinism import offered_memory_bytes

__all__ = [
    "CPU_STAGES",
    "INJECT_OOM_ENV",
    "LORA_CHECK",
    "MEMORY_CAP_ENV",
    "SetupLaps",
    "StageClock",
    "apply_memory_cap",
    "check_finite",
    "ltx2_sigmas",
]

INJECT_OOM_ENV = "LTX_MGPU_INJECT_OOM"
#: A smaller card emulated on a larger one (benchmarks, the memory plan's check on an H200 as an 80 GB card): GiB
#: this rank's caching allocator may hold (`torch.cuda.set_per_process_memory_fraction`); the CUDA context and
#: library workspaces outside the allocator are not capped, so give what the emulated card *offers* a rank.
MEMORY_CAP_ENV = "LTX_MGPU_MEMORY_CAP_GIB"


def apply_memory_cap(device: torch.device) -> float | None:
    """Cap this rank's allocator at `MEMORY_CAP_ENV` GiB when set (CUDA only); returns the cap applied."""
    raw = os.environ.get(MEMORY_CAP_ENV)
    if not raw or torch.device(device).type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, float(raw) * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return float(raw)


class SetupLaps:
    """Seconds per part of a runner's `setup()`, lap by lap (`lap(name)` closes the part that just ran).

    The device is synchronised at each lap so a part's asynchronous copies are charged to it. The results travel
    with the rank's ready message (`ltx_mgpu.control.startup.RankStartup`): `phases_s`, and on CUDA `memory_gib`,
    what each part left allocated on the device (GiB): the resident set as measured, part by part, which the
    memory plan's figures are checked against (docs/memory.md)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.phases_s: dict[str, float] = {}
        self.memory_gib: dict[str, float] = {}
        self._last = time.perf_counter()
        self._held = self._allocated()

    def _allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases_s[name] = round(self.phases_s.get(name, 0.0) + now - self._last, 3)
        self._last = now
        if self.device.type == "cuda":
            held = self._allocated()
            self.memory_gib[name] = round(self.memory_gib.get(name, 0.0) + (held - self._held) / 2**30, 3)
            self._held = held


#: a job's LoRA header checks on the driver rank (`job_loras`), before its first stage: host work, and part of
#: the job's LoRA cost (the worker's `lora_swap_s` sums every `lora_swap*` timing)
LORA_CHECK = "lora_swap_check"
#: stages that run on the host only: the fleet is held but its devices wait (not device-busy time)
CPU_STAGES = frozenset({"mux", LORA_CHECK})


class StageClock:
    """Seconds and peak memory per stage of the current job on this rank; `reset()` at each job start."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.timings_s: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.reserved: dict[str, int] = {}  #: the allocator's reservation peak per stage (what runs out)
        self.reserved_report: dict[str, list[int]] | None = None  #: every rank's, from the last `peak_report`
        self.window: list[float] = []  #: wall clock [first stage start, last device stage end]; [] before any

    def reset(self) -> None:
        self.timings_s, self.peaks, self.reserved, self.window = {}, {}, {}, []
        self.reserved_report = None

    def gpu_report(self) -> dict[str, object]:
        """`gpu_busy_s` (seconds of device stages), `gpu_started_at` / `gpu_ended_at` (wall clock)."""
        busy = sum(v for k, v in self.timings_s.items() if k not in CPU_STAGES)
        started, ended = self.window if self.window else (None, None)
        report: dict[str, object] = {"gpu_busy_s": round(busy, 6), "gpu_started_at": started, "gpu_ended_at": ended}
        if (offered := offered_memory_bytes(self.device)) is not None:
            report["device_memory_bytes"] = offered
        return report

    def release(self) -> None:
        """Hand the allocator's cached blocks back between stages (the lower-memory plan): the next stage's
        peak then starts from what is really held, not from the previous stage's cache."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        # the stage's own stream (NCCL work joins it): copies a stage starts on a side stream on purpose (a text
        # encoder's copy back, a clean-weight restore) run on beside the next stages and are waited for by
        # the stage that needs them, which is where their remaining time shows
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        _injected_oom(name)
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        if not self.window:
            self.window = [time.time(), time.time()]
        yield
        self._sync()
        self.timings_s[name] = round(time.perf_counter() - start, 6)
        if name not in CPU_STAGES:
            self.window[1] = time.time()
        if self.device.type == "cuda":
            self.peaks[name] = int(torch.cuda.max_memory_allocated(self.device))
            self.reserved[name] = int(torch.cuda.max_memory_reserved(self.device))

    def peak_report(self, world_size: int, group: Any) -> dict[str, list[int]] | None:
        """Collective (every rank): per-stage peak memory of every rank, None on CPU fleets. Stages only
        some ranks ran (the driver's audio decode and mux) report 0 for the others."""
        if self.device.type != "cuda":
            return None
        mine = (self.peaks, self.reserved)
        gathered: list[Any] = [mine]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine, group=group)
        stages = list(dict.fromkeys(name for peaks, _ in gathered for name in peaks))
        self.reserved_report = {stage: [int(res.get(stage, 0)) for _, res in gathered] for stage in stages}
        return {stage: [int(peaks.get(stage, 0)) for peaks, _ in gathered] for stage in stages}


def _injected_oom(stage: str) -> None:
    path = os.environ.get(INJECT_OOM_ENV)
    if not path:
        return
    try:
        with open(path) as fh:
            lines = {line.strip() for line in fh}
    except OSError:
        return
    if stage in lines:
        raise torch.OutOfMemoryError(f"injected out-of-memory error in stage {stage} ({INJECT_OOM_ENV})")


def ltx2_sigmas(steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """ltx-core's `LTX2Scheduler` schedule for `steps` steps over a latent of `latent_shape` (float32), with
    one step meaning the plain [1, 0]: ltx-core's own answer for a single step starts with NaN, which
    silently made every 1-step render noise-free garbage (and its audio unencodable)."""
    from ltx_core.components.schedulers import LTX2Scheduler

    if int(steps) == 1:
        return torch.tensor([1.0, 0.0], dtype=torch.float32)
    probe = torch.empty(tuple(latent_shape), device="meta")
    return LTX2Scheduler().execute(steps=int(steps), latent=probe).to(torch.float32)


def check_finite(**latents: torch.Tensor) -> None:
    """Raise `RunnerError` naming the first latent that holds NaN/inf. The denoised latents are identical
    on every rank, so every rank raises the same error: a recoverable symmetric failure, and nothing is
    decoded or written from garbage."""
    from ...control.errors import RunnerError

    for name, latent in latents.items():
        if not bool(torch.isfinite(latent).all()):
            raise RunnerError(f"the denoised {name} latent is not finite (NaN/inf); nothing was written")
