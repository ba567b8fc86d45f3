"""`ltx-worker plan`: the memory plan of one request on a fleet layout, without a fleet (docs/memory.md).

    ltx-worker plan --runner ltx2-two-stage --group 0 --size 1536x1024x121 --gpu h100-80gb
    ltx-worker plan --runner ltx2-distilled --group 0,1 --size 1536x1024x241 --json
    ltx-worker plan --runner ltx2-distilled                  # the presets on 1, 2, 4 and 8 GPUs (a table)
    ltx-worker plan --runner ltx2-two-stage --gpu h100-80gb --quantization fp8-mm+attn   # another setup's plan

The runner comes from the worker's registry and its setup kwargs from the worker's settings
(`LTX_RUNNER_SETUP`, `--settings FILE`), so the plan is the one the worker would make, on a card: `--gpu NAME`
(`ltx_mgpu.spec.placement.CARDS`), `--free-gib` (what each device offers), `LTX_DEVICE_MEMORY_GIB`, else the
local GPU (NVML or nvidia-smi, no CUDA context); every line names it. The fleet is placed as the worker places it
before loading (`LTX_PLACEMENT`), and a fleet that fits in no placement says so. A GPU group on a machine that
names no card gets its plan without the memory check and exit 2 (nothing to check it against: say which card);
the table then plans for the H100 80GB, the card most users have. A CPU group has no memory limit.

With `--group` and `--size`: that plan in full; otherwise a table of each size (default: `request_rules.PRESETS`)
on `--gpus` ranks: fits, or why not and the largest size that fits (a size the runner's rules and the request
schema accept). Every request rule is checked (sizes, the clip's duration at `--frame-rate`), as `--dry-run` and
the runner check it.

Arithmetic only: the ltx2 runners are described by `ltx_mgpu.runners.ltx2.spec` (no torch); another runner's
class is imported. Exit 0 when the request fits (or some asked size fits somewhere in the table), 1 when the
plan refuses it (every size of the table), 2 on a usage error or when no card is known to check it against.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from worker.settings import SettingsError, WorkerSettings, load_settings, resolve_runner, validate_group

if TYPE_CHECKING:  # (imported when the command runs: `ltx-worker` itself stays free of the engine)
    from ltx_mgpu.spec import memory_plan
    from ltx_mgpu.spec.placement import Card

__all__ = ["command", "fleet_memory", "render_table", "render_text"]

TABLE_CARD = "h100-80gb"  #: the table's card when none is named or found


def _weights_text(fleet: memory_plan.FleetMemory) -> str:
    return "fp8 transformer" if fleet.fp8_transformer else "bf16 transformer"


def _card_text(card: Card | None, headroom: float) -> str:
    if card is None:
        return "no card named (memory not checked)"
    return f"{card.name}: {card.offered_gib:g} GiB per GPU less {headroom:g} headroom"


def render_text(
    plan: memory_plan.MemoryPlan,
    runner: str,
    group: str,
    largest: dict[str, str | None] | None,
    card: Card | None,
    placement_note: str = "",
) -> str:
    """The plan as an operator reads it: the card, placement (with `placement_note`: the host memory it was
    chosen for), resident parts per rank, releases, decode tiling, stage peaks, and the verdict, each line naming
    the card."""
    f = plan.fleet
    w, h, n = plan.size
    where = _card_text(card, f.headroom_gib)
    tag = f"[{card.name if card else 'no card'}]"
    lines = [
        f"memory plan: {runner} ({f.runner}, {f.passes} pass(es) per stage-1 step) on group {group} "
        f"({f.world_size} rank(s)), {w}x{h}x{n} at {plan.frame_rate:g} fps, profile {f.profile}, "
        f"{_weights_text(f)}, {where}"
    ]
    placed = ", ".join(f"{k} {v}" for k, v in f.placement.items())
    lines.append(f"{tag} placement: {placed}" + (f" ({placement_note})" if placement_note else ""))
    ranks = sorted(plan.resident_gib)
    parts = list(dict.fromkeys(k for r in ranks for k in plan.resident_gib[r]))
    lines.append(f"{tag} resident (GiB)      " + "".join(f"{'rank ' + str(r):>10}" for r in ranks))
    for part in parts:
        cells = "".join(
            f"{plan.resident_gib[r].get(part, 0.0):>10.2f}" if part in plan.resident_gib[r] else f"{'-':>10}"
            for r in ranks
        )
        lines.append(f"{tag}   {part:<18}{cells}")
    lines.append(f"{tag}   {'total':<18}" + "".join(f"{sum(plan.resident_gib[r].values()):>10.2f}" for r in ranks))
    released = "the allocator cache, after every stage" if plan.release_between_stages else "nothing"
    parked = "; the text encoder parked from stage 1 to the decode" if plan.park_text_encoder else ""
    lines.append(f"{tag} released between stages: {released}{parked}")
    how = (
        "each tile in ltx-core's default chunks (512 px tiles, 64 px overlap; 64 frames, 24 overlap)"
        if plan.decode_chunked
        else "each tile whole (the fastest)"
    )
    lines.append(
        f"{tag} decode: {plan.decode_tiles} spatial tile(s), one per rank, {f.vae_overlap} latent cell(s) "
        f"of overlap; {how}"
    )
    if plan.rule_problem is None:
        lines.append(f"{tag} {'stage':<10}{'worst rank':>11}{'allocated':>11}{'reserved':>10}  (GiB)")
        lines.extend(
            f"{tag} {s.stage:<10}{s.rank:>11}{s.allocated_gib:>11.2f}{s.reserved_gib:>10.2f}" for s in plan.stages
        )
    lines.extend(f"{tag} note: {note}" for note in plan.notes)
    if not plan.fits:
        lines.append(f"{tag} fits: NO: {plan.refusal()}")
        if largest is not None:
            lines.append(
                f"{tag} largest that fits: " + (" or ".join(s for s in largest.values() if s) or "none near it")
            )
    elif card is None and plan.fleet.capacity_gib is None and group[:3] != "cpu":
        lines.append(
            f"{tag} fits: UNKNOWN: the request rules accept it; name the card to check its memory "
            "(--gpu h100-80gb|h200 or --free-gib)"
        )
    else:
        lines.append(
            f"{tag} fits: yes (peak {plan.peak.reserved_gib:.1f} GiB at {plan.peak.stage} on rank {plan.peak.rank})"
        )
    return "\n".join(lines)


def _fail(message: str) -> None:
    click.echo(f"ltx-worker plan: {message}", err=True)
    sys.exit(2)


def fleet_memory(
    settings: WorkerSettings, world_size: int, capacity_gib: float | None, headroom_gib: float
) -> memory_plan.FleetMemory:
    """The fleet the worker with `settings` would plan for on `world_size` ranks (placement not yet chosen): the
    ltx2 runners from their torch-free description (`ltx_mgpu.runners.ltx2.spec`), any other runner from its
    class (imported). `SettingsError` when the runner describes no memory."""
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


def _placed(
    settings: WorkerSettings, fleet: memory_plan.FleetMemory, card: Card | None
) -> tuple[memory_plan.FleetMemory, str]:
    """`fleet` as the worker places it on `card` (`worker.render.fleet_plan`), and what the choice assumed (the
    host memory it had: this machine's unless `--host-gib` names the target's); unplaceable: the all-GPU one,
    whose plan then says what does not fit."""
    from ltx_mgpu.spec import placement as pl

    if card is None:
        return fleet, ""
    explicit = settings.runner_setup.get("placement")
    if explicit is None and settings.placement != "auto":
        explicit = json.loads(settings.placement)
    if explicit is not None:
        return replace(fleet, **{f"{k}_at": v for k, v in explicit.items()}), "set by the settings"
    host, budget = _host_budget(settings)
    best, _ = pl.choose(fleet, card, host_gib=host)
    if best is None:
        return fleet, f"no placement fits with {budget}; the all-GPU plan follows"
    return replace(best.fleet, capacity_gib=fleet.capacity_gib), f"chosen for {budget}"


def _host_budget(settings: WorkerSettings) -> tuple[float | None, str]:
    """The pinned host memory the placement may take, and where that figure came from (a plan made on a laptop
    for an H100 box needs the box's: `--host-gib`)."""
    from worker.render.fleet_plan import host_budget_gib

    host = host_budget_gib(settings)
    if host is None:
        return None, "host memory unknown"
    if settings.host_memory_gib is not None:
        return host, f"{host:.1f} GiB of pinned host memory (--host-gib / LTX_HOST_MEMORY_GIB)"
    return host, f"{host:.1f} GiB of pinned host memory, this machine's (--host-gib names the target's)"


def render_table(
    rows: list[dict[str, Any]], runner: str, card: Card, headroom: float, host_note: str = "", weights: str = ""
) -> str:
    """One line per (size, GPUs), naming the card: the predicted reserved peak and its stage, the placement,
    fits or the reason and the largest size that fits (a size the rules refuse has no peak). `host_note`: the
    host memory the placements were chosen for; `weights`: the transformer's dtype as the plan counts it."""
    lines = [
        f"memory plans (predicted, not measured): {runner}, sequence parallel over the GPUs, "
        + (f"{weights}, " if weights else "")
        + f"{_card_text(card, headroom)}"
        + (f"; placements for {host_note}" if host_note else ""),
        f"{'size':<16}{'GPUs':>5}  {'card':<11}{'peak GiB':>9}  {'at':<9}{'fits':<5} plan / why not; largest that fits",
    ]
    for row in rows:
        peak = f"{'-':>9}  {'-':<9}" if row["rule_problem"] else f"{row['peak_gib']:>9.1f}  {row['stage']:<9}"
        head = f"{row['size']:<16}{row['gpus']:>5}  {card.name:<11}{peak}"
        if row["fits"]:
            how = ("lower-memory (chunked decode)" if row["low_memory"] else "fast") + (
                ", text encoder parked" if row["parked"] else ""
            )
            lines.append(f"{head}{'yes':<5} {how}; placement {row['placement']}")
        else:
            fits = " or ".join(s for s in (row["largest"] or {}).values() if s) or "none near it"
            lines.append(f"{head}{'NO':<5} {row['reason']}; largest that fits: {fits}")
    return "\n".join(lines)


def _with_quantization(settings: WorkerSettings, name: str) -> WorkerSettings:
    """`settings` with the runner's setup `quantization` replaced (`none`: bf16); a name the runners do not know is
    a usage error here, as it would fail the fleet's setup."""
    from ltx_mgpu.runners.ltx2.spec import QUANTIZATIONS, describe

    if describe(settings.runner_registry[settings.runner]) is None:
        raise ValueError(f"--quantization is a setup of the ltx2 runners, not of {settings.runner!r}")
    if name != "none" and name not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be none or one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    setup = {**settings.runner_setup, "quantization": None if name == "none" else name}
    return settings.model_copy(update={"runner_setup": setup})


def _card(gpu: str | None, free_gib: float | None, settings: WorkerSettings, group: str | None) -> Card | None:
    """The card the plan is for: `--free-gib`, `--gpu`, `LTX_DEVICE_MEMORY_GIB`, else the group's local GPU."""
    from ltx_mgpu.control.devices import parse_device_group
    from ltx_mgpu.spec.placement import CARDS, Card
    from worker.render.fleet_plan import local_card

    if gpu is not None and gpu not in CARDS:
        raise ValueError(f"--gpu must be one of {sorted(CARDS)} (or give --free-gib), got {gpu!r}")
    base = CARDS[gpu] if gpu is not None else None
    if free_gib is not None or settings.device_memory_gib is not None:
        offered = float(free_gib if free_gib is not None else settings.device_memory_gib)
        return Card(
            f"{base.name}@{offered:g}" if base else f"{offered:g}GiB",
            offered,
            (base or CARDS[TABLE_CARD]).h2d_gbps,
            "given",
        )
    if base is not None:
        return base
    devices = parse_device_group(group) if group else ["cuda:0"]
    found = local_card(devices) if devices[0] != "cpu" else None
    return None if found is None else found[0]


@click.command("plan")
@click.option("--runner", required=True, help="runner name from the registry (e.g. ltx2-distilled, ltx2-two-stage)")
@click.option("--group", default=None, help="the fleet's device group (0 / 0,1 / cpu:2); unset: a table over --gpus")
@click.option("--size", "sizes", multiple=True, help="WIDTHxHEIGHTxFRAMES, e.g. 1536x1024x241 (default: the presets)")
@click.option("--gpus", default="1,2,4,8", help="the table's fleet sizes (comma-separated)")
@click.option("--frame-rate", type=float, default=None, help="frames per second, 1-120 (the clip's duration); 24")
@click.option("--gpu", default=None, help="the card: h100-80gb or h200 (default: the local GPU)")
@click.option("--free-gib", type=float, default=None, help="GiB each device offers (default LTX_DEVICE_MEMORY_GIB)")
@click.option("--headroom-gib", type=float, default=None, help="GiB kept free (default LTX_MEMORY_HEADROOM_GIB)")
@click.option(
    "--host-gib", type=float, default=None, help="pinned host memory the fleet may take (default LTX_HOST_MEMORY_GIB)"
)
@click.option(
    "--quantization",
    default=None,
    help="the transformer's quantization for this plan: none (bf16), fp8-mm, fp8-mm+attn, fp8-cast or "
    "fp8-scaled-mm (default: the settings' LTX_RUNNER_SETUP)",
)
@click.option("--low-memory", is_flag=True, help="the lower-memory plan (what an out-of-memory retry takes)")
@click.option("--settings", "settings_file", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True, help="print the plan (or each row of the table) as JSON")
def command(
    runner: str,
    group: str | None,
    sizes: tuple[str, ...],
    gpus: str,
    frame_rate: float | None,
    gpu: str | None,
    free_gib: float | None,
    headroom_gib: float | None,
    host_gib: float | None,
    quantization: str | None,
    low_memory: bool,
    settings_file: str | None,
    as_json: bool,
) -> None:
    """Print the memory plan of one request on a fleet layout, or a table of sizes on 1-8 GPUs (no GPU needed)."""
    from ltx_mgpu.control.devices import parse_device_group
    from ltx_mgpu.spec import memory_plan
    from ltx_mgpu.spec.bounds import RANGES
    from ltx_mgpu.spec.placement import CARDS
    from ltx_mgpu.spec.request_rules import PRESETS

    rate = memory_plan.DEFAULT_FRAME_RATE if frame_rate is None else float(frame_rate)
    try:
        settings = load_settings(settings_file, runner=runner)
        if host_gib is not None:  # the target machine's host memory, for a plan made elsewhere
            if host_gib < 0:
                raise ValueError(f"--host-gib must be >= 0, got {host_gib:g}")
            settings = settings.model_copy(update={"host_memory_gib": host_gib})
        if quantization is not None:  # a plan for another setup than the settings' own
            settings = _with_quantization(settings, quantization)
        parsed = [memory_plan.parse_size(s) for s in (sizes or PRESETS)]
        worlds = [len(parse_device_group(validate_group(group)))] if group else [int(g) for g in gpus.split(",")]
        low, high = RANGES["frame_rate"]
        if not low <= rate <= high or any(not 1 <= w <= 4096 for w in worlds):
            raise ValueError(
                f"--frame-rate must be in [{low:g}, {high:g}] (the request schema's) and --gpus counts in [1, 4096]"
            )
        card = _card(gpu, free_gib, settings, group)
        if gpu is None and free_gib is None and settings.device_memory_gib is None:  # (the local GPUs: as the worker)
            from worker.render.fleet_plan import check_quantization

            check_quantization(settings, parse_device_group(group) if group else ["cuda:0"])
        headroom = headroom_gib if headroom_gib is not None else settings.memory_headroom_gib
        if group is None and card is None:
            card = CARDS[TABLE_CARD]
        capacity = None if card is None else card.offered_gib
        placed = {w: _placed(settings, fleet_memory(settings, w, capacity, headroom), card) for w in worlds}
        fleets = {w: fleet for w, (fleet, _) in placed.items()}
    except (SettingsError, ValueError) as exc:
        _fail(str(exc))
    if group and len(parsed) == 1:
        _one(placed[worlds[0]], parsed[0], runner, group, card, rate, low_memory, as_json)
    _table(fleets, parsed, runner, card, headroom, rate, low_memory, as_json, _host_budget(settings)[1])


def _one(
    placed: tuple[Any, str],
    size: tuple[int, int, int],
    runner: str,
    group: str,
    card: Card | None,
    rate: float,
    low_memory: bool,
    as_json: bool,
) -> None:
    from ltx_mgpu.spec import memory_plan

    fleet, placement_note = placed
    plan = memory_plan.plan(fleet, *size, low_memory=low_memory, frame_rate=rate)
    largest = None if plan.fits or plan.rule_problem else memory_plan.largest(fleet, *size, frame_rate=rate)
    unchecked = card is None and not group.startswith("cpu") and plan.fits
    if as_json:
        out = {
            "runner": runner,
            "group": group,
            "card": None if card is None else card.name,
            **plan.to_json(),
            "largest": largest,
            "memory_checked": not unchecked,
            "placement_note": placement_note,
        }
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(render_text(plan, runner, group, largest, card, placement_note))
    sys.exit(2 if unchecked else 0 if plan.fits else 1)


def _table(
    fleets: dict[int, Any],
    sizes: list,
    runner: str,
    card: Card,
    headroom: float,
    rate: float,
    low_memory: bool,
    as_json: bool,
    host_note: str = "",
) -> None:
    from ltx_mgpu.spec import memory_plan

    rows = []
    for size in sizes:
        for world, fleet in fleets.items():
            p = memory_plan.plan(fleet, *size, low_memory=low_memory, frame_rate=rate)
            largest = None if p.fits or p.rule_problem else memory_plan.largest(fleet, *size, frame_rate=rate)
            rows.append(
                {
                    "size": "x".join(map(str, size)),
                    "gpus": world,
                    "card": card.name,
                    "fits": p.fits,
                    "low_memory": p.low_memory,
                    "parked": p.park_text_encoder,
                    "peak_gib": p.peak.reserved_gib,
                    "stage": p.peak.stage,
                    "reason": p.refusal(),
                    "rule_problem": p.rule_problem,
                    "largest": largest,
                    "placement": ",".join(f"{k}={v}" for k, v in fleet.placement.items()),
                    "fp8_transformer": fleet.fp8_transformer,
                }
            )
    if as_json:
        click.echo("\n".join(json.dumps({"runner": runner, **row}, sort_keys=True) for row in rows))
    else:
        click.echo(render_table(rows, runner, card, headroom, host_note, _weights_text(next(iter(fleets.values())))))
    sys.exit(0 if any(row["fits"] for row in rows) else 1)
