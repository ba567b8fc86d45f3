"""`ltx-worker plan`: the memory plan of one request on a fleet layout, without a fleet (docs/memory.md).

    ltx-worker plan --runner ltx2-two-stage --group 0 --size 1536x1024x121 --free-gib 139
    ltx-worker plan --runner ltx2-distilled --group 0,1 --size 1536x1024x241 --json

The runner comes from the worker's registry and its setup kwargs from the worker's settings
(`LTX_RUNNER_SETUP`, `--settings FILE`), so the plan is the one the worker would make; `--free-gib` stands in
for the memory a GPU fleet measures after its warm-up (default `LTX_DEVICE_MEMORY_GIB`; neither: no limit).
Exit 0 when the request fits, 1 when the plan refuses it, 2 on a usage error.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from worker.runtime.settings import SettingsError, load_settings, resolve_runner, validate_group

if TYPE_CHECKING:  # (imported when the command runs: `ltx-worker` itself stays free of the engine)
    from ltx_mgpu import memplan

__all__ = ["command", "render_text"]


def render_text(plan: memplan.MemoryPlan, runner: str, group: str, largest: dict[str, str | None] | None) -> str:
    """The plan as an operator reads it: resident parts per rank, releases, decode tiling, stage peaks."""
    f = plan.fleet
    w, h, n = plan.size
    limit = "no limit"
    if plan.limit_gib is not None:
        limit = f"limit {plan.limit_gib:.1f} GiB per device ({f.capacity_gib:g} GiB less {f.headroom_gib:g} headroom)"
    lines = [f"memory plan: {runner} ({f.runner}, {f.passes} pass(es) per stage-1 step) on group {group} "
             f"({f.world_size} rank(s)), {w}x{h}x{n}, profile {f.profile}, {limit}"]  # fmt: skip
    ranks = sorted(plan.resident_gib)
    parts = list(dict.fromkeys(k for r in ranks for k in plan.resident_gib[r]))
    lines.append("resident (GiB)      " + "".join(f"{'rank ' + str(r):>10}" for r in ranks))
    for part in parts:
        cells = "".join(f"{plan.resident_gib[r][part]:>10.2f}" if part in plan.resident_gib[r] else f"{'-':>10}"
                        for r in ranks)  # fmt: skip
        lines.append(f"  {part:<18}{cells}")
    lines.append("  " + f"{'total':<18}" + "".join(f"{sum(plan.resident_gib[r].values()):>10.2f}" for r in ranks))
    released = "the allocator cache, after every stage" if plan.release_between_stages else "nothing"
    lines.append(f"released between stages: {released} (the models above stay resident)")
    how = ("each tile in ltx-core's default chunks (512 px tiles, 64 px overlap; 64 frames, 24 overlap)"
           if plan.decode_chunked else "each tile whole (the fastest)")  # fmt: skip
    lines.append(f"decode: {plan.decode_tiles} spatial tile(s), one per rank, {f.vae_overlap} latent cell(s) of "
                 f"overlap; {how}")  # fmt: skip
    lines.append(f"{'stage':<10}{'worst rank':>11}{'allocated':>11}{'reserved':>10}  (GiB)")
    for s in plan.stages:
        lines.append(f"{s.stage:<10}{s.rank:>11}{s.allocated_gib:>11.2f}{s.reserved_gib:>10.2f}")
    lines.extend(f"note: {note}" for note in plan.notes)
    if plan.fits:
        lines.append(f"fits: yes (peak {plan.peak.reserved_gib:.1f} GiB at {plan.peak.stage} on rank {plan.peak.rank})")
    else:
        lines.append(f"fits: NO: {plan.refusal()}")
        if largest:
            lines.append("largest that fits: " + (" or ".join(s for s in largest.values() if s) or "none near it"))
    return "\n".join(lines)


def _fail(message: str) -> None:
    click.echo(f"ltx-worker plan: {message}", err=True)
    sys.exit(2)


@click.command("plan")
@click.option("--runner", required=True, help="runner name from the registry (e.g. ltx2-distilled, ltx2-two-stage)")
@click.option("--group", required=True, help="the fleet's device group (0 / 0,1 / cpu:2)")
@click.option("--size", required=True, help="the request's WIDTHxHEIGHTxFRAMES, e.g. 1536x1024x241")
@click.option("--free-gib", type=float, default=None, help="GiB each device offers (default LTX_DEVICE_MEMORY_GIB)")
@click.option("--headroom-gib", type=float, default=None, help="GiB kept free (default LTX_MEMORY_HEADROOM_GIB)")
@click.option("--low-memory", is_flag=True, help="the lower-memory plan (what an out-of-memory retry takes)")
@click.option("--settings", "settings_file", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def command(runner: str, group: str, size: str, free_gib: float | None, headroom_gib: float | None, low_memory: bool,
            settings_file: str | None, as_json: bool) -> None:  # fmt: skip
    """Print the memory plan of one request on a fleet layout (no fleet, no GPU needed)."""
    from ltx_mgpu import memplan
    from ltx_mgpu.control.devices import parse_device_group

    try:
        settings = load_settings(settings_file, runner=runner)
        devices = parse_device_group(validate_group(group))
        width, height, frames = memplan.parse_size(size)
        runner_cls = resolve_runner(settings)
    except (SettingsError, ValueError) as exc:
        _fail(str(exc))
    describe = getattr(runner_cls, "memory_fleet", None)
    if describe is None:
        _fail(f"runner {runner!r} describes no memory (only the ltx2 runners do)")
    fleet: memplan.FleetMemory = describe(len(devices), **settings.runner_setup)
    capacity = free_gib if free_gib is not None else settings.device_memory_gib
    headroom = headroom_gib if headroom_gib is not None else settings.memory_headroom_gib
    fleet = memplan.FleetMemory(**{**fleet.to_json(), "capacity_gib": capacity, "headroom_gib": headroom})
    fleet = memplan.with_lora_limits(fleet, *settings.lora_limits())
    plan = memplan.plan(fleet, width, height, frames, low_memory=low_memory)
    largest = None if plan.fits else memplan.largest(fleet, width, height, frames)
    if as_json:
        out: dict[str, Any] = {"runner": runner, "group": group, **plan.to_json(), "largest": largest}
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(render_text(plan, runner, group, largest))
    sys.exit(0 if plan.fits else 1)
