"""`ltx-worker plan`: the memory plan of one request on a fleet layout, without a fleet (docs/memory.md).

    ltx-worker plan --runner ltx2-two-stage --group 0 --size 1536x1024x121 --free-gib 139
    ltx-worker plan --runner ltx2-distilled --group 0,1 --size 1536x1024x241 --json
    ltx-worker plan --runner ltx2-distilled                  # the presets on 1, 2, 4 and 8 GPUs (a table)

The runner comes from the worker's registry and its setup kwargs from the worker's settings
(`LTX_RUNNER_SETUP`, `--settings FILE`), so the plan is the one the worker would make; `--free-gib` stands in
for the memory a GPU fleet measures after its warm-up (default `LTX_DEVICE_MEMORY_GIB`; neither: no limit,
but the table assumes one H200, 139.5 GiB). With `--group` and `--size`: that plan in full; otherwise a table
of each size (default: `request_rules.PRESETS`) on `--gpus` ranks: fits, or why not and the largest size
that fits (a size the runner's rules and the request schema accept).

Arithmetic only: the ltx2 runners are described by `ltx_mgpu.runners.ltx2.spec` (no torch); another runner's
class is imported. Exit 0 when the request fits (or a table was printed), 1 when the plan refuses it, 2 on a
usage error.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from worker.settings import SettingsError, WorkerSettings, load_settings, resolve_runner, validate_group

if TYPE_CHECKING:  # (imported when the command runs: `ltx-worker` itself stays free of the engine)
    from ltx_mgpu.spec import memory_plan

__all__ = ["command", "fleet_memory", "render_table", "render_text"]

H200_GIB = 139.5  #: what one H200 offers a rank after its CUDA context: the table's default


def render_text(plan: memory_plan.MemoryPlan, runner: str, group: str, largest: dict[str, str | None] | None) -> str:
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


def fleet_memory(settings: WorkerSettings, world_size: int, capacity_gib: float | None,
                 headroom_gib: float) -> memory_plan.FleetMemory:  # fmt: skip
    """The fleet the worker with `settings` would plan for on `world_size` ranks: the ltx2 runners from their
    torch-free description (`ltx_mgpu.runners.ltx2.spec`), any other runner from its class (imported).
    `SettingsError` when the runner describes no memory."""
    from ltx_mgpu.runners.ltx2 import spec
    from ltx_mgpu.spec import memory_plan

    kind = spec.describe(settings.runner_registry[settings.runner])
    if kind is not None:
        fleet = spec.memory_fleet(kind, world_size, settings.runner_setup)
    else:
        describe = getattr(resolve_runner(settings), "memory_fleet", None)
        if describe is None:
            raise SettingsError(f"runner {settings.runner!r} describes no memory (only the ltx2 runners do)")
        fleet = describe(world_size, **settings.runner_setup)
    fleet = memory_plan.FleetMemory(**{**fleet.to_json(), "capacity_gib": capacity_gib, "headroom_gib": headroom_gib})
    return memory_plan.with_lora_limits(fleet, *settings.lora_limits())


def render_table(rows: list[dict[str, Any]], runner: str, capacity: float | None, headroom: float) -> str:
    """One line per (size, GPUs): the predicted reserved peak and its stage, fits or the reason and the
    largest size that fits."""
    limit = "no limit" if capacity is None else f"{capacity:g} GiB per GPU less {headroom:g} headroom"
    lines = [
        f"memory plans (predicted, not measured): {runner}, sequence parallel over the GPUs, {limit}",
        f"{'size':<16}{'GPUs':>5}{'peak GiB':>10}  {'at':<9}{'fits':<5} plan / why not; largest that fits",
    ]
    for row in rows:
        head = f"{row['size']:<16}{row['gpus']:>5}{row['peak_gib']:>10.1f}  {row['stage']:<9}"
        if row["fits"]:
            how = "lower-memory (chunked decode)" if row["low_memory"] else "fast"
            lines.append(f"{head}{'yes':<5} {how}")
        else:
            fits = " or ".join(s for s in (row["largest"] or {}).values() if s) or "none near it"
            lines.append(f"{head}{'NO':<5} {row['reason']}; largest that fits: {fits}")
    return "\n".join(lines)


@click.command("plan")
@click.option("--runner", required=True, help="runner name from the registry (e.g. ltx2-distilled, ltx2-two-stage)")
@click.option("--group", default=None, help="the fleet's device group (0 / 0,1 / cpu:2); unset: a table over --gpus")
@click.option("--size", "sizes", multiple=True, help="WIDTHxHEIGHTxFRAMES, e.g. 1536x1024x241 (default: the presets)")
@click.option("--gpus", default="1,2,4,8", help="the table's fleet sizes (comma-separated)")
@click.option("--frame-rate", type=float, default=None, help="frames per second (the clip's audio length); 24")
@click.option("--free-gib", type=float, default=None, help="GiB each device offers (default LTX_DEVICE_MEMORY_GIB)")
@click.option("--headroom-gib", type=float, default=None, help="GiB kept free (default LTX_MEMORY_HEADROOM_GIB)")
@click.option("--low-memory", is_flag=True, help="the lower-memory plan (what an out-of-memory retry takes)")
@click.option("--settings", "settings_file", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True, help="print the plan (or each row of the table) as JSON")
def command(runner: str, group: str | None, sizes: tuple[str, ...], gpus: str, frame_rate: float | None,
            free_gib: float | None, headroom_gib: float | None, low_memory: bool, settings_file: str | None,
            as_json: bool) -> None:  # fmt: skip
    """Print the memory plan of one request on a fleet layout, or a table of sizes on 1-8 GPUs (no GPU needed)."""
    from ltx_mgpu.control.devices import parse_device_group
    from ltx_mgpu.spec import memory_plan
    from ltx_mgpu.spec.request_rules import PRESETS

    rate = memory_plan.DEFAULT_FRAME_RATE if frame_rate is None else float(frame_rate)
    try:
        settings = load_settings(settings_file, runner=runner)
        parsed = [memory_plan.parse_size(s) for s in (sizes or PRESETS)]
        worlds = [len(parse_device_group(validate_group(group)))] if group else [int(g) for g in gpus.split(",")]
        if not 0 < rate <= 1000 or any(not 1 <= w <= 4096 for w in worlds):
            raise ValueError("--frame-rate must be in (0, 1000] and --gpus counts in [1, 4096]")
        capacity = free_gib if free_gib is not None else settings.device_memory_gib
        if capacity is None and not group:
            capacity = H200_GIB
        headroom = headroom_gib if headroom_gib is not None else settings.memory_headroom_gib
        fleets = {w: fleet_memory(settings, w, capacity, headroom) for w in worlds}
    except (SettingsError, ValueError) as exc:
        _fail(str(exc))
    if group and len(parsed) == 1:
        fleet = fleets[worlds[0]]
        plan = memory_plan.plan(fleet, *parsed[0], low_memory=low_memory, frame_rate=rate)
        largest = None if plan.fits else memory_plan.largest(fleet, *parsed[0], frame_rate=rate)
        if as_json:
            out: dict[str, Any] = {"runner": runner, "group": group, **plan.to_json(), "largest": largest}
            click.echo(json.dumps(out, sort_keys=True))
        else:
            click.echo(render_text(plan, runner, group, largest))
        sys.exit(0 if plan.fits else 1)
    rows = []
    for size in parsed:
        for world, fleet in fleets.items():
            p = memory_plan.plan(fleet, *size, low_memory=low_memory, frame_rate=rate)
            largest = None if p.fits else memory_plan.largest(fleet, *size, frame_rate=rate)
            rows.append({"size": "x".join(map(str, size)), "gpus": world, "fits": p.fits, "low_memory": p.low_memory,
                         "peak_gib": p.peak.reserved_gib, "stage": p.peak.stage, "reason": p.refusal(),
                         "largest": largest})  # fmt: skip
    if as_json:
        click.echo("\n".join(json.dumps({"runner": runner, **row}, sort_keys=True) for row in rows))
    else:
        click.echo(render_table(rows, runner, capacity, headroom))
    sys.exit(0)
