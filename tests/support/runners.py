"""Fault-injection runners for the worker tests.

The runners are registered in the worker under test by import path (`RUNNERS`, passed as `LTX_RUNNERS` by
`tests.support.workers.worker_env`), and the controller ships them to the ranks by value, so they live here
rather than in an installed package. Requests are
validated by the real `RenderRequest` (unknown fields are rejected), so the test behaviour is steered
through the prompt: space-separated `key=value` directives, e.g. "t step_s=0.3 record=/tmp/x.jsonl".

| directive       | effect                                                                   |
|-----------------|--------------------------------------------------------------------------|
| step_s=F        | sleep F seconds per step (on every rank) before the cancel point         |
| bytes=N         | size of the output file (default 4096), content derived from the seed    |
| record=PATH     | the driver appends {"event": "start"/"end", "pid", "t", "job", "memory_plan"} lines |
| error=runner    | raise RunnerError on every rank (recoverable, the fleet survives)        |
| error=oom       | raise torch.OutOfMemoryError on every rank after one yield (job ends)    |
| error=type      | the same with TypeError (`runtime`: RuntimeError); the fleet survives    |
| error=oom_unless_low | error=oom unless the job's `memory_plan` asks for the chunked decode   |
| error=oom_tail  | the driver raises torch.OutOfMemoryError after the others finished (a driver-only stage) |
| error_rank=R    | with error=...: only rank R raises; the others wait in a collective      |
| exit_rank=R     | rank R calls os._exit(9) at step `exit_step` (default 2): a dead rank    |
| segv_rank=R     | rank R dies of SIGSEGV at step `exit_step`: a crash of the job's own doing |
| no_output=1     | finish without writing a file                                            |
| hold=PATH       | before the first step, wait (cancellable, at most 120 s) until PATH exists |
| yuv=N           | `media="frames"`: N noise frames (width x height) as a `media` event, no file; "stream": streamed |
| chunk=K, chunk_s=F | with yuv, "stream": K frames a chunk (default all), F seconds before each         |
| stream_fail=K   | with yuv, "stream": every rank raises RunnerError before chunk K (after the buffer went out) |

FaultRunner describes its memory (`memory_fleet`, as the ltx2 runners do) only with the setup kwarg
`memory_profile` (e.g. "tiny"): a worker then plans, publishes and refuses by `LTX_DEVICE_MEMORY_GIB`. It
takes request LoRAs (`takes_request_loras`: the worker fetches them, the runner ignores them) only with the
setup kwarg `request_loras` (the worker reads their targets from setup `checkpoint_path`, as for ltx2).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ltx_mgpu import MGPURunner, RunnerError
from ltx_mgpu.control.events import output_event, progress_event, stage_event

RUNNERS = {
    "fault": "tests.support.runners:FaultRunner",
    "broken": "tests.support.runners:BrokenSetupRunner",
}


def directives(prompt: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in prompt.split() if "=" in part)


def output_bytes(seed: int, size: int) -> bytes:
    """The deterministic content FaultRunner writes (tests recompute it to check sha256 end to end)."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048
    out = bytearray()
    while len(out) < size:
        out += block
    return bytes(out[:size])


_INJECTED: dict[str, type[Exception]] = {"oom": torch.OutOfMemoryError, "type": TypeError, "runtime": RuntimeError}


class FaultRunner(MGPURunner):
    """A fast runner with injectable faults; see the module docstring."""

    media_modes = ("mp4", "frames", "stream")

    @classmethod
    def takes_request_loras(cls, **setup_kwargs: Any) -> bool:
        return bool(setup_kwargs.get("request_loras"))

    @classmethod
    def memory_fleet(cls, world_size: int, **setup_kwargs: Any) -> Any:
        from ltx_mgpu.spec.memory_plan import FleetMemory

        profile = setup_kwargs.get("memory_profile")
        loras = bool(setup_kwargs.get("memory_request_loras"))  # a LoRA tracker, bound by the worker's LoRA limits
        return None if profile is None else FleetMemory("distilled", world_size, profile=profile, lora_tracker=loras,
                                                        request_loras=int(loras))  # fmt: skip

    def setup(
        self,
        *,
        fail_if_exists: str | None = None,
        setup_s: float = 0.0,
        slow_if_exists: str | None = None,
        slow_s: float = 0.0,
        synthetic_checkpoint: str | None = None,
        **_: Any,
    ) -> None:
        """`fail_if_exists`: raise if that file exists (a test creates it to make *rebuilds* fail).
        `setup_s`: sleep that long (a model load); `slow_if_exists`: sleep `slow_s` more if that file exists
        (a test creates it to make *rebuilds* slow). `synthetic_checkpoint`: check it as the LTX-2 runners
        check theirs (`warn_if_synthetic`: the driver rank warns when it holds synthetic weights)."""
        if synthetic_checkpoint:
            from ltx_mgpu.runners.common.loading import warn_if_synthetic

            warn_if_synthetic(synthetic_checkpoint, announce=self.is_driver)
        if fail_if_exists and os.path.exists(fail_if_exists):
            raise RuntimeError(f"injected setup failure ({fail_if_exists} exists)")
        time.sleep(setup_s + (slow_s if slow_if_exists and os.path.exists(slow_if_exists) else 0.0))
        self.pid = os.getpid()

    def __call__(
        self,
        *,
        output_path: str,
        prompt: str,
        seed: int = 42,
        steps: int | None = None,
        width: int = 64,
        height: int = 64,
        num_frames: int = 9,
        frame_rate: float = 24.0,
        media: str = "mp4",
        memory_plan: dict | None = None,
        **_ignored: Any,
    ) -> Iterator[dict[str, Any]]:
        d = directives(prompt)
        steps = int(steps or 2)
        record = d.get("record")
        job = Path(output_path).parent.name
        if record and self.is_driver:
            _append(record, {"event": "start", "pid": os.getpid(), "t": time.time(), "job": job,
                             "memory_plan": memory_plan})  # fmt: skip
        if d.get("error") == "oom_unless_low" and not (memory_plan or {}).get("decode_chunked"):
            d["error"] = "oom"
        if d.get("error") == "runner":
            raise RunnerError("injected runner error")
        if d.get("error") == "crash":  # a fleet-level fault (sticky CUDA error): the rank dies with a traceback
            raise RuntimeError(f"CUDA error: an illegal memory access (injected crash for {prompt!r})")
        if d.get("error") in _INJECTED:
            yield progress_event("denoise", 0, steps) if self.is_driver else {}
            if "error_rank" not in d or int(d["error_rank"]) == self.rank:
                raise _INJECTED[d["error"]](f"injected {d['error']} error")
            dist.all_reduce(torch.ones(1), group=self.groups.transformer_group)  # the raising rank never comes
        if self.is_driver:
            yield stage_event("denoise")
        if d.get("hold"):  # a test holds the fleet busy until it creates this file
            deadline = time.monotonic() + 120
            while not os.path.exists(d["hold"]) and time.monotonic() < deadline:
                self.raise_if_cancelled()
                time.sleep(0.05)
        exit_rank = int(d["exit_rank"]) if "exit_rank" in d else None
        segv_rank = int(d["segv_rank"]) if "segv_rank" in d else None
        exit_step = int(d.get("exit_step", 2))
        for step in range(1, steps + 1):
            time.sleep(float(d.get("step_s", 0)))
            if exit_rank == self.rank and step == exit_step:
                os._exit(9)
            if segv_rank == self.rank and step == exit_step:
                os.kill(os.getpid(), signal.SIGSEGV)
            self.raise_if_cancelled()
            if self.is_driver:
                yield progress_event("denoise", step, steps)
        if media == "stream" and "yuv" in d:
            yield from _noise_stream(self, d, width, height, frame_rate, seed)
            if self.is_driver:
                yield output_event(output_path, frames=int(d["yuv"]), fps=frame_rate, width=width, height=height,
                                   size_bytes=0, media="stream", gpu_busy_s=0.25)  # fmt: skip
        elif self.is_driver and media == "frames" and "yuv" in d:
            yield _noise_media(int(d["yuv"]), width, height, frame_rate, seed)
            yield output_event(output_path, frames=int(d["yuv"]), fps=frame_rate, width=width, height=height,
                               size_bytes=0, media="frames", gpu_busy_s=0.25)  # fmt: skip
        elif self.is_driver:
            if d.get("error") == "oom_tail":  # (the other ranks have returned: nobody waits in a collective)
                raise torch.OutOfMemoryError("injected oom in the driver's mux")
            if d.get("no_output") != "1":
                data = output_bytes(seed, int(d.get("bytes", 4096)))
                Path(output_path).write_bytes(data)
                yield output_event(output_path, frames=num_frames, fps=frame_rate, width=width, height=height,
                                   size_bytes=len(data))  # fmt: skip
            if record:
                _append(record, {"event": "end", "pid": os.getpid(), "t": time.time(), "job": job})


def noise_frames(frames: int, width: int, height: int, seed: int) -> torch.Tensor:
    """uint8 RGB noise (F, H, W, 3): the encoder's worst case, slow enough to watch it run."""
    return torch.randint(0, 256, (frames, height, width, 3), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)  # fmt: skip


def _noise_media(frames: int, width: int, height: int, fps: float, seed: int) -> dict[str, Any]:
    """A `media` hand-off of `noise_frames` in yuv420p."""
    from ltx_mgpu.media.mp4 import media_event, shared_host_copy, to_yuv420p

    yuv = to_yuv420p(noise_frames(frames, width, height, seed))
    return media_event(shared_host_copy(yuv), width=width, height=height, fps=fps, audio=None)


def _noise_stream(runner: Any, d: dict, width: int, height: int, fps: float, seed: int) -> Iterator[dict]:
    """The same frames as `_noise_media`, streamed (`FrameStream`) in chunks of `chunk` after `chunk_s` each."""
    from ltx_mgpu.runners.common.handoff import FrameStream

    total, chunk, rgb = int(d["yuv"]), int(d.get("chunk", d["yuv"])), noise_frames(int(d["yuv"]), width, height, seed)
    stream = FrameStream(frames=total, width=width, height=height, fps=fps, device=torch.device("cpu"))
    yield from ([stage_event("decode"), stream.open_event()] if runner.is_driver else [])
    for k, lo in enumerate(range(0, total, chunk)):
        time.sleep(float(d.get("chunk_s", 0)))
        runner.raise_if_cancelled()
        if "stream_fail" in d and int(d["stream_fail"]) == k:  # (every rank: a symmetric runner error)
            raise RunnerError(f"injected failure mid-decode, before chunk {k}")
        if runner.is_driver:
            yield stream.put(rgb[lo : lo + chunk])
    if runner.is_driver:
        yield stream.close_event(None)


class BrokenSetupRunner(MGPURunner):
    """Its setup always fails: the fleet can never be built."""

    def setup(self, **_: Any) -> None:
        raise RuntimeError("injected setup failure")

    def __call__(self, **_: Any) -> Iterator[Any]:
        yield None


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
