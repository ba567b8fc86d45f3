"""What `python -m bench.e2e runs` runs: one `RunSpec` per worker start, the preset plans, and the request sizes.

Sizes: a workload's request is the one-stage default (768x512, 121 frames: LTX-2's one-stage CLI default and
SGLang's sampling default) unless a run names another. The reference's two-stage and distilled CLIs default to
1536x1024, and a ten-second video at 24 fps is 241 frames, so the `sizes-*` plans cover 768x512x121,
1536x1024x121 and 1536x1024x241 for both runner families on one GPU and on two. A size a fleet cannot hold is
refused by the worker's memory plan (`ltx_mgpu.spec.memory_plan`) before any GPU work: the run records the refusal.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from bench.e2e.stack import Workload

__all__ = ["PLANS", "SIZES", "RunSpec", "determinism_cost", "parse_size", "refusal", "sized", "with_determinism"]

#: The sizes of the presets: the one-stage default, the two-stage/distilled CLI default, ten seconds of it.
SIZES = ("768x512x121", "1536x1024x121", "1536x1024x241")

_SIZE = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def parse_size(text: str) -> tuple[int, int, int]:
    """ "WxHxF" -> (width, height, num_frames); `ValueError` for anything else (argparse shows it)."""
    match = _SIZE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"size must be WIDTHxHEIGHTxFRAMES (e.g. 1536x1024x121), got {text!r}")
    width, height, frames = (int(g) for g in match.groups())
    return width, height, frames


def sized(workload: Workload, size: str | None) -> Workload:
    """`workload` with its request at `size` ("WxHxF"; None: as it is). The setup is left as it is: the
    runners' default SP budget (`memory_plan.sp_tokens`) takes every size their rules accept."""
    if size is None:
        return workload
    width, height, frames = parse_size(size)
    request = {**workload.request, "width": width, "height": height, "num_frames": frames}
    return dataclasses.replace(workload, request=request)


def refusal(workload: Workload, world_sizes: list[int]) -> str | None:
    """What the memory plan (`ltx_mgpu.spec.memory_plan`, without a capacity: only the token budget) refuses before any
    worker starts: a run the fleet would refuse costs no cold start."""
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner
    from ltx_mgpu.spec import memory_plan

    runner_cls = Ltx2DistilledRunner if workload.runner == "ltx2-distilled" else Ltx2TwoStageRunner
    r = workload.request
    for world in world_sizes:
        fleet = runner_cls.memory_fleet(world, **workload.setup)
        if message := memory_plan.plan(fleet, r["width"], r["height"], r["num_frames"]).refusal():
            return message
    return None


@dataclass(frozen=True)
class RunSpec:
    """One worker start: a workload on a layout, and what to measure there."""

    runner: str  #: "ltx2-distilled", "ltx2-two-stage", "ltx2-two-stage:cfg"
    groups: tuple[str, ...]  #: one fleet per group
    warm: int  #: jobs one at a time (latency)
    backlog: int  #: jobs queued at once (throughput, idle gap)
    rebuild: bool  #: kill a rank mid-job and time the recovery
    encode: str = "worker"  #: "worker": the worker encodes beside the next job; "fleet": the driver rank does
    size: str | None = None  #: "WxHxF" of the request; None: the workload's own (the one-stage default)
    #: the worker's `LTX_DETERMINISTIC` ("on", "strict", "off"); None: the worker's default (auto)
    deterministic: str | None = None

    def worker_env(self) -> dict[str, str]:
        """The `LTX_*` variables this run sets beyond the workload's: where the mp4 is encoded, determinism."""
        env = {"LTX_ENCODE_IN_WORKER": str(self.encode != "fleet"), "LTX_ENCODE_STREAM": str(self.encode != "once")}
        return env if self.deterministic is None else {**env, "LTX_DETERMINISTIC": self.deterministic}

    @property
    def layout(self) -> str:
        return ";".join(self.groups)

    @property
    def label(self) -> str:
        return f"{self.runner} @ {self.layout}" + (f" @ {self.size}" if self.size else "")


def _by_size(groups: tuple[str, ...]) -> list[RunSpec]:
    """Both runner families at every preset size on `groups`, smallest first (a refusal ends nothing)."""
    return [RunSpec(runner, groups, warm=3, backlog=0, rebuild=False, size=size)
            for size in SIZES for runner in ("ltx2-distilled", "ltx2-two-stage:cfg")]  # fmt: skip


#: Preset plans, most important first (--budget-s cuts from the end). `gpu2`: about 9-10 minutes at real
#: size on two H200s (five worker starts of ~35-50 s, ~55 renders). `sizes-gpu1` / `sizes-gpu2`: six worker
#: starts each, three warm renders per size (1536x1024x241 two-stage is ~2 minutes a render on one GPU).
PLANS: dict[str, list[RunSpec]] = {
    "gpu2": [
        RunSpec("ltx2-distilled", ("0,1",), warm=5, backlog=8, rebuild=True),
        RunSpec("ltx2-two-stage:cfg", ("0,1",), warm=5, backlog=0, rebuild=False),
        RunSpec("ltx2-distilled", ("0", "1"), warm=0, backlog=8, rebuild=False),
        RunSpec("ltx2-two-stage", ("0,1",), warm=5, backlog=0, rebuild=False),
        RunSpec("ltx2-two-stage:cfg", ("0", "1"), warm=0, backlog=8, rebuild=False),
    ],
    "sizes-gpu1": _by_size(("0",)),
    "sizes-gpu2": _by_size(("0,1",)),
}


def with_determinism(specs: list[RunSpec], mode: str | None) -> list[RunSpec]:
    """`--deterministic` / `--no-deterministic`: every run in that mode; "both": every run twice, deterministic
    ("on") then not ("off"), one after the other on the same machine (`determinism_cost` compares them)."""
    if mode is None:
        return specs
    if mode != "both":
        return [dataclasses.replace(s, deterministic=mode) for s in specs]
    return [dataclasses.replace(s, deterministic=m) for s in specs for m in ("on", "off")]


def determinism_cost(runs: list[dict]) -> dict[str, float]:
    """What the deterministic mode costs, measured side by side: per run measured both ways, the deterministic
    run's e2e p50 over the other's (1.02 = 2% slower) and its throughput over the other's."""
    out: dict[str, float] = {}
    key = lambda r: (r["runner"], r["variant"], r["layout"], r.get("size"), r.get("encode"))  # noqa: E731
    off = {key(r): r for r in runs if r.get("deterministic") == "off"}
    for r in runs:
        other = off.get(key(r))
        if r.get("deterministic") in ("on", "strict") and other is not None:
            name = f"{r['runner']}:{r['variant']} {r['layout']}{' ' + r['size'] if r.get('size') else ''} " \
                   f"deterministic {r['deterministic']} vs off"  # fmt: skip
            for metric in ("e2e_p50_s", "videos_per_hour"):
                if r.get(metric) and other.get(metric):
                    out[f"{name}: {metric}"] = round(r[metric] / other[metric], 4)
    return out
