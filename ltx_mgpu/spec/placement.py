"""Where a fleet keeps each component that need not live on the GPU, chosen before anything loads
(docs/memory.md, "Placement").

A fleet keeps what every denoising step reads on the GPU (the transformer, the VAE decoder). Three parts are
read once per job or less, and may live in pinned host memory instead, copied to the GPU when a job needs them:

- `text_encoder` (Gemma, on its rank): `gpu`, `park` or `stream`. A parked encoder keeps a pinned host mirror
  beside its GPU copy; a job whose plan needs the room drops the GPU copy after its encode and copies it back
  after its decode (its bytes over the host link, per parked job). A job that fits with it resident pays
  nothing. A streamed encoder keeps only two of its layers on the GPU (its token table stays in host memory
  and gathers there): every encode copies its layers in one ahead of their use (their bytes over the host
  link, every job), for cards too small to hold Gemma beside the transformer even for the encode.
- `lora_backup` (the LoRA tracker's clean copy): `gpu` or `host`. Restored from the host on every swap back to
  clean weights: once per two-stage job, beside the video decode on one GPU.
- `lora_factors` (the setup LoRAs' kept factors, the two-stage distilled LoRA): `gpu` or `host`. Copied to the
  GPU weight by weight by every fusion: once per two-stage job.

`choose()` takes the placement with the fewest seconds per job at the fleet's design size (its warm-up
requests, else `DESIGN_SIZE`) whose resident set and design-size plan fit the card and whose host parts fit the
host memory the fleet may pin; ties go to the one that leaves the GPU the most room (a `park` text encoder
costs nothing until a job needs it). `None` when nothing fits: the worker refuses the fleet before loading
(`refusal()`: what does not fit and what would).

The cards (`CARDS`): what one device offers a rank after its CUDA context, and the pinned host-to-device copy
rate, measured (`python -m bench.host_link`, `ltx-worker plan` against the ranks' own report); a card not in
the table is described by its total memory less `CONTEXT_GIB`.

Stdlib only (the producer imports the plan).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ltx_mgpu.spec.memory_plan import FleetMemory, MemoryPlan

__all__ = [
    "CARDS",
    "CONTEXT_GIB",
    "DESIGN_SIZE",
    "STREAMED_ENHANCE_REFUSAL",
    "TIERS",
    "Card",
    "Choice",
    "card_for",
    "choose",
    "host_parts",
    "judge",
    "refusal",
    "seconds_per_job",
    "smallest",
]

GB = 1e9
GIB = float(1 << 30)
#: component -> its tiers, the first the all-GPU default (`FleetMemory` field: `<component>_at`)
TIERS: dict[str, tuple[str, ...]] = {
    "text_encoder": ("gpu", "park", "stream"),
    "lora_backup": ("gpu", "host"),
    "lora_factors": ("gpu", "host"),
}
#: what the CUDA context, cuBLAS/NCCL workspaces and the driver take from a card's total before a rank's
#: allocator sees it, where the card is not in `CARDS` (H100 80GB: 79.2 GiB total, 76.9 offered)
CONTEXT_GIB = 2.3
#: Why a fleet whose text encoder streams refuses prompt enhancement (the runners on every rank, and the contract's
#: limits at the edge): each generated token is a forward over every layer, so the stack would cross the host
#: link once per token (Gemma 12B: 20 GiB, ~0.4 s a token).
STREAMED_ENHANCE_REFUSAL = (
    "enhance_prompt is not available on this fleet: its text encoder streams its layers from host memory "
    "(placement 'stream', a card too small to hold it), which would copy them once per generated token"
)
#: the size a fleet is placed for when it has no warm-up requests: the default request (768x512, 5 s)
DESIGN_SIZE = (768, 512, 121)


@dataclass(frozen=True)
class Card:
    """One GPU model as the plan sees it."""

    name: str  #: the `--gpu` name
    offered_gib: float  #: what one device offers a rank after its CUDA context (free + the rank's reservation)
    h2d_gbps: float  #: pinned host-to-device copy, GB/s (1e9 bytes)
    source: str  #: where the figures come from

    def describe(self) -> str:
        return f"{self.name} ({self.offered_gib:g} GiB offered per GPU)"


#: Cards the figures were measured on (docs/memory.md, "Per card").
CARDS: dict[str, Card] = {
    # H100 link: PCIe Gen5 x16 like the H200 host's, not measured on an H100 host yet
    "h100-80gb": Card("h100-80gb", 76.9, 50.0, "offered: the worker's plan on one H100 80GB HBM3, 2026-12-07"),
    "h200": Card("h200", 139.5, 55.5, "offered: the ranks' report, 2026-12-01; link: bench.host_link, 2026-12-07"),
}
#: NVML / torch device-name fragments -> card
_NAMES = (("H100", "h100-80gb"), ("H200", "h200"))


def card_for(device_name: str, total_bytes: int, h2d_gbps: float | None = None) -> Card:
    """The card of a local device: a known one by name (its measured figures), else its total memory less
    `CONTEXT_GIB` (named after the device). `h2d_gbps`: a rate measured here, replacing the table's."""
    for fragment, key in _NAMES:
        if fragment in device_name.upper():
            card = CARDS[key]
            total_gib = total_bytes / GIB
            if total_gib and abs(total_gib - CONTEXT_GIB - card.offered_gib) > 8:  # (an H100 NVL, a cut-down part)
                card = Card(f"{key}-{total_gib:.0f}gib", round(total_gib - CONTEXT_GIB, 1), card.h2d_gbps, device_name)
            return card if h2d_gbps is None else replace(card, h2d_gbps=float(h2d_gbps))
    name = "-".join(device_name.lower().replace("nvidia", "").split()) or "gpu"
    return Card(name, round(total_bytes / GIB - CONTEXT_GIB, 1), h2d_gbps or 25.0, f"{device_name}: total less context")


def _gpu_parts(fleet: FleetMemory) -> dict[str, float]:
    """GiB the movable components take on their worst rank when on the GPU (for `host_parts`)."""
    from ltx_mgpu.spec.memory_plan import PROFILES, lora_parts

    p = PROFILES[fleet.profile]
    parts = lora_parts(replace(fleet, lora_backup_at="gpu", lora_factors_at="gpu"), p)
    out = {"lora_backup": parts.get("lora_backup", 0.0), "lora_factors": parts.get("lora_factors", 0.0)}
    out["text_encoder"] = p.text_encoder_gib
    out["text_encoder_layers"] = p.text_encoder_layers_gib or p.text_encoder_gib
    return out


def host_parts(fleet: FleetMemory) -> dict[str, float]:
    """GiB of pinned host memory the fleet's placement takes, all ranks together (they share the host)."""
    per_rank = _gpu_parts(fleet)
    world = fleet.world_size
    out: dict[str, float] = {}
    if fleet.text_encoder_at in ("park", "stream"):
        key = "text_encoder" if fleet.text_encoder_at == "park" else "text_encoder_layers"
        out["text_encoder"] = per_rank[key] * (world if fleet.gemma_every_rank else 1)
    if fleet.has_tracker and fleet.lora_backup_at == "host":
        out["lora_backup"] = per_rank["lora_backup"] * world  # (the worst rank's share: an upper bound)
    if fleet.has_tracker and fleet.lora_factors_at == "host" and per_rank["lora_factors"]:
        out["lora_factors"] = per_rank["lora_factors"] * world
    return {k: round(v, 2) for k, v in out.items()}


def seconds_per_job(fleet: FleetMemory, card: Card, plan: MemoryPlan | None = None) -> float:
    """Host-link seconds a job spends on the placement: the clean copy and the setup LoRAs' factors once per
    two-stage job (its two swaps), the text encoder when `plan` parks it, its layers at every encode when it
    is streamed."""
    per_rank = _gpu_parts(fleet)
    gib = 0.0
    swaps = fleet.runner == "two-stage" and fleet.has_tracker
    if swaps and fleet.lora_backup_at == "host":
        gib += per_rank["lora_backup"]
    if swaps and fleet.lora_factors_at == "host":
        gib += per_rank["lora_factors"]
    if plan is not None and plan.park_text_encoder:
        gib += per_rank["text_encoder"]
    if fleet.text_encoder_at == "stream":
        gib += per_rank["text_encoder_layers"]
    return gib * GIB / (card.h2d_gbps * GB)


@dataclass(frozen=True)
class Choice:
    """A placement considered for a fleet, and how it fares at the design size."""

    fleet: FleetMemory  #: the fleet with this placement
    plan: MemoryPlan  #: the design size's plan on it
    host_gib: float  #: pinned host memory it takes
    seconds: float  #: host-link seconds every job pays (a parked text encoder's copy is paid per parked job)
    problem: str | None  #: why it cannot be chosen (None: it can)

    @property
    def placement(self) -> dict[str, str]:
        return {c: getattr(self.fleet, f"{c}_at") for c in TIERS}


def _candidates(fleet: FleetMemory) -> list[FleetMemory]:
    names = [c for c in TIERS if c == "text_encoder" or fleet.has_tracker]
    out = []
    for tiers in itertools.product(*(TIERS[c] for c in names)):
        out.append(replace(fleet, **{f"{c}_at": t for c, t in zip(names, tiers, strict=True)}))
    return out


def judge(
    fleet: FleetMemory, card: Card, host_gib: float | None, sizes: Sequence[tuple[int, int, int]] = (DESIGN_SIZE,)
) -> Choice:
    """How `fleet`'s placement fares on `card`: its plans at `sizes`, host memory, seconds, and its problem."""
    from ltx_mgpu.spec.memory_plan import plan

    fleet = replace(fleet, capacity_gib=card.offered_gib if fleet.capacity_gib is None else fleet.capacity_gib)
    plans = [plan(fleet, *size) for size in sizes]
    worst = max(plans, key=lambda p: p.peak.reserved_gib)
    failing = next((p for p in plans if not p.fits), None)
    host = sum(host_parts(fleet).values())
    problem = None
    if failing is not None:
        problem = failing.refusal()
    elif host_gib is not None and host > host_gib:
        problem = f"needs {host:.1f} GiB of pinned host memory, over the {host_gib:.1f} GiB this fleet may pin"
    # what every job pays (the LoRA tiers); a parked text encoder is paid only by the jobs that need its room,
    # which without it would run chunked or be refused, so it is never a reason to keep the encoder resident
    seconds = seconds_per_job(fleet, card)
    return Choice(fleet, worst, round(host, 2), round(seconds, 3), problem)


def choose(
    fleet: FleetMemory,
    card: Card,
    *,
    host_gib: float | None = None,
    sizes: Sequence[tuple[int, int, int]] = (DESIGN_SIZE,),
) -> tuple[Choice | None, list[Choice]]:
    """The fastest placement of `fleet` (its capacity: the card's) that runs `sizes`, and every one judged
    (the fastest first). `host_gib`: the pinned host memory this fleet may take (None: no limit). Where no
    placement runs `sizes`, the one that runs the smallest request the runner's rules accept (`smallest()`):
    a fleet is refused only when it cannot hold its resident set and one minimal job; larger requests are then
    refused per request, by the plan, with the sizes that fit."""
    for tried in (list(sizes), [smallest(fleet)]):
        judged = [judge(f, card, host_gib, tried) for f in _candidates(fleet)]
        judged.sort(key=lambda c: (c.problem is not None, c.seconds, _resident_after_encode(c), c.host_gib))
        if judged and judged[0].problem is None:
            return judged[0], judged
    return None, judged


def smallest(fleet: FleetMemory) -> tuple[int, int, int]:
    """The smallest request the fleet's runner accepts: one spatial multiple square, 1 + 8 frames."""
    rules = fleet.rules
    return (rules.spatial_multiple, rules.spatial_multiple, rules.temporal_multiple + 1)


def _resident_after_encode(choice: Choice) -> float:
    """What stays on the worst rank's GPU once a job may park (smaller first: more room for large jobs)."""
    fleet = choice.fleet
    rank_parts = choice.plan.resident_gib.get(fleet.gemma_rank, {})
    total = sum(rank_parts.values())
    return total - (rank_parts.get("text_encoder", 0.0) if fleet.text_encoder_at == "park" else 0.0)


def refusal(fleet: FleetMemory, card: Card, judged: list[Choice], alternatives: Mapping[str, Any]) -> str:
    """One line: the fleet cannot hold its resident set on this card in any placement, the closest one's
    reason, and what would fit (`alternatives`: a label -> that fleet's best `Choice` or None)."""
    closest = min(judged, key=lambda c: c.plan.peak.reserved_gib) if judged else None
    what = closest.problem if closest is not None else "no placement"
    where = ", ".join(f"{k} {v}" for k, v in closest.placement.items()) if closest is not None else ""
    fits = [label for label, choice in alternatives.items() if choice is not None]
    hint = ("; would fit: " + " or ".join(fits)) if fits else "; nothing smaller fits on this card"
    return (
        f"{fleet.runner} on {fleet.world_size} x {card.describe()} cannot hold its resident set in any "
        f"placement (closest: {where}: {what}){hint}"
    )
