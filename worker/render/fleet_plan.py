"""A fleet's placement, decided before anything loads: which card it runs on, where its movable components live
(`ltx_mgpu.spec.placement`), and whether it can hold its resident set at all (docs/memory.md, "Placement").

`place_fleet()` runs in the worker process before the fleet starts. It reads the card of the group's GPUs
without creating a CUDA context (NVML, else `nvidia-smi`), the pinned host memory this worker may take
(`LTX_HOST_MEMORY_GIB`, else the machine's available memory less a reserve, shared by the groups), and
resolves `LTX_PLACEMENT` ("auto", or a fixed placement) into the runner's `placement` setup kwarg. A fleet that
fits in no placement is a configuration error (`SettingsError`: exit 2, one line naming what does not fit and
what would), so the supervisor does not restart a worker whose fleet could never load; so is a quantization the
group's GPUs cannot run (`check_quantization`: fp8 GEMMs on an A100).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from worker.render import gpu_query
from worker.settings import SettingsError, WorkerSettings

__all__ = ["FleetPlacement", "check_quantization", "group_capability", "host_budget_gib", "local_card", "place_fleet"]

log = logging.getLogger("worker.render.fleet_plan")

HOST_RESERVE_GIB = 8.0  #: host memory left to the processes, the page cache and the encoders


@dataclass(frozen=True)
class FleetPlacement:
    """The decision: the setup kwargs the fleet starts with (its `placement` included), and why."""

    setup_kwargs: dict[str, Any]
    card: Any = None  #: `ltx_mgpu.spec.placement.Card`, None on CPU fleets without a memory setting
    choice: Any = None  #: the chosen `placement.Choice`, None where nothing was chosen (CPU, not an ltx2 runner)

    @property
    def capacity_gib(self) -> float | None:
        """What one device of the card offers a rank (the plan's capacity before the fleet measures its own)."""
        return None if self.card is None else float(self.card.offered_gib)

    def describe(self) -> str:
        if self.choice is None:
            return "placement: the runner's own (no card to plan for)"
        where = ", ".join(f"{k} {v}" for k, v in self.choice.placement.items())
        return (
            f"placement on {self.card.describe()}: {where}; {self.choice.host_gib:g} GiB pinned host memory, "
            f"{self.choice.seconds:g} s of host copies per job"
        )


def group_capability(devices: list[str]) -> tuple[str, tuple[int, int]] | None:
    """The name and compute capability of the group's least capable GPU, from NVML or nvidia-smi (no CUDA
    context); None for a CPU group or where neither answers."""
    indices = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    if not indices:
        return None
    found = gpu_query.capabilities(indices)
    return min(found, key=lambda row: row[1]) if found else None


def check_quantization(settings: WorkerSettings, devices: list[str]) -> None:
    """A quantization the group's GPUs cannot run is a configuration error before anything loads
    (`ltx_mgpu.spec.gpu_needs`, the table the ranks check too): `SettingsError`, exit 2, one line."""
    from ltx_mgpu.spec.gpu_needs import capability_problem

    quantization = settings.runner_setup.get("quantization")
    found = group_capability(devices) if quantization else None
    if found is None:  # (nothing quantized, a CPU group, or no NVML nor nvidia-smi: the ranks check it then)
        return
    problem = capability_problem(quantization, found[1], found[0])
    if problem is not None:
        raise SettingsError(f"GPU group {','.join(devices)}: {problem}")


def local_card(devices: list[str]) -> tuple[Any, float] | None:
    """The card of a GPU group (the smallest of its devices) and the least free memory among them (GiB, before
    the fleet's CUDA contexts), from NVML or nvidia-smi; None for a CPU group or where neither answers."""
    from ltx_mgpu.spec.placement import CONTEXT_GIB, card_for

    indices = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    if not indices:
        return None
    found = gpu_query.memory(indices)
    if not found:
        return None
    name, total, _ = min(found, key=lambda row: row[1])
    free_gib = min(row[2] for row in found) / 2**30 - CONTEXT_GIB
    return card_for(name, total), free_gib


def host_budget_gib(settings: WorkerSettings) -> float | None:
    """Pinned host memory this worker's fleet may take: `LTX_HOST_MEMORY_GIB`, else the memory available now less
    `HOST_RESERVE_GIB`, divided by the groups this machine runs (None where /proc/meminfo cannot be read)."""
    if settings.host_memory_gib is not None:
        return float(settings.host_memory_gib)
    try:
        with open("/proc/meminfo") as fh:
            fields = {line.split(":")[0]: line.split()[1] for line in fh}
        available = int(fields["MemAvailable"]) * 1024 / 2**30
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return max(0.0, available - HOST_RESERVE_GIB) / max(1, len(settings.groups))


def _explicit(settings: WorkerSettings) -> dict[str, str] | None:
    if "placement" in settings.runner_setup:
        return dict(settings.runner_setup["placement"] or {})
    if settings.placement == "auto":
        return None
    return dict(json.loads(settings.placement))


def place_fleet(settings: WorkerSettings, devices: list[str], fleet: Any) -> FleetPlacement:
    """The setup kwargs and placement of the fleet on `devices` (see the module docstring). `fleet`: the
    runner's `FleetMemory` without a placement (None: the runner describes no memory: its setup unchanged)."""
    from ltx_mgpu.spec import placement as pl

    check_quantization(settings, devices)
    setup = dict(settings.runner_setup)
    explicit = _explicit(settings)
    found = local_card(devices)
    card = found[0] if found else None
    if settings.device_memory_gib is not None:
        rate = (card or pl.CARDS["h100-80gb"]).h2d_gbps
        card = pl.Card("LTX_DEVICE_MEMORY_GIB", float(settings.device_memory_gib), rate, "the setting")
    elif card is not None and found is not None and found[1] < card.offered_gib - 0.5:
        card = replace(card, offered_gib=round(found[1], 1), source=f"{card.source}; less what other processes hold")
    if fleet is None:
        return FleetPlacement(setup)
    if card is None:  # a CPU fleet without a memory setting: nothing to fit, the placement as configured
        if explicit is not None:
            setup["placement"] = explicit
        return FleetPlacement(setup)
    fleet = replace(fleet, capacity_gib=card.offered_gib, headroom_gib=settings.memory_headroom_gib)
    sizes = [(int(r["width"]), int(r["height"]), int(r["num_frames"])) for r in settings.warmup_jobs()]
    sizes = sizes or [pl.DESIGN_SIZE]
    host = host_budget_gib(settings)
    if explicit is not None:
        fleet = replace(fleet, **{f"{k}_at": v for k, v in explicit.items()})
        judged = [pl.judge(fleet, card, host, sizes)]
        best = judged[0] if judged[0].problem is None else None
    else:
        best, judged = pl.choose(fleet, card, host_gib=host, sizes=sizes)
    if best is None:
        raise SettingsError(pl.refusal(fleet, card, judged, _alternatives(fleet, card, host, sizes, len(devices))))
    setup["placement"] = best.placement
    return FleetPlacement(setup, card, best)


def _alternatives(fleet: Any, card: Any, host: float | None, sizes: list, world: int) -> dict[str, Any]:
    """What would fit instead: fp8 weights, more GPUs per group, more pinned host memory."""
    from ltx_mgpu.spec import placement as pl

    out: dict[str, Any] = {}
    if not fleet.fp8_transformer:
        out["quantization 'fp8-mm' (LTX_RUNNER_SETUP)"] = pl.choose(
            replace(fleet, fp8_transformer=True), card, host_gib=host, sizes=sizes
        )[0]
    for more in (2 * world, 4 * world):
        if more <= 8:
            out[f"{more} GPUs per group"] = pl.choose(
                replace(fleet, world_size=more, text_encoder_rank=None), card, host_gib=host, sizes=sizes
            )[0]
    if host is not None:
        unlimited = pl.choose(fleet, card, host_gib=None, sizes=sizes)[0]
        if unlimited is not None:
            out[f"LTX_HOST_MEMORY_GIB >= {unlimited.host_gib:g}"] = unlimited
    return out
