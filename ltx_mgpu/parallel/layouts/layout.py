"""Parallel layouts of a fleet: G guidance groups x S sequence-parallel ranks, G * S = W.

A guided denoising step runs P passes of the transformer (conditional, negative prompt, STG-perturbed,
modality-isolated). Under layout G x S the fleet splits into G groups of S consecutive ranks; group g runs
its share of the passes batched, with SP over its S ranks, and the G groups run at the same time. The
ranks that hold the same SP position in every group (the *guidance peers*) then exchange their denoised
outputs in one all-gather, so every rank ends the step with all P outputs (see `guidance.py`).

    W = 4, layout 2x2:   group 0 = ranks {0, 1}   group 1 = ranks {2, 3}     (SP inside a group)
                         guidance peers {0, 2} and {1, 3}                    (one all-gather per step)

`1xW` is plain SP (every unguided stage runs that way); `Wx1` is guidance parallelism alone.

Process groups: `dist.new_group` is collective (every rank calls it for every group, in the same order),
so `LayoutGroups.build` makes the groups of *every* layout of the world once, at setup; nothing is made
per job. The whole-world group of the fleet (the transformer group) serves as the SP group of `1xW` and as
the guidance group of `Wx1`; groups of size one are never made (a rank alone needs no communicator). New
groups: W = 2 and 3 need none, W = 4 needs 4 (layout 2x2), W = 8 needs 12 (2x4 and 4x2). NCCL creates a
communicator lazily, on its first collective, so groups of layouts a fleet never picks cost nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["LayoutGroups", "LayoutRank", "ParallelLayout", "layout_groups", "layouts_for"]

_LAYOUT_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class ParallelLayout:
    """G guidance groups of S sequence-parallel ranks (written "GxS")."""

    guidance: int  #: G: how many rank groups run passes at the same time
    sequence: int  #: S: ranks per group, splitting the video tokens (SP)

    def __post_init__(self) -> None:
        if self.guidance < 1 or self.sequence < 1:
            raise ValueError(f"a layout needs G >= 1 and S >= 1, got {self.guidance}x{self.sequence}")

    @property
    def world_size(self) -> int:
        return self.guidance * self.sequence

    @property
    def name(self) -> str:
        return f"{self.guidance}x{self.sequence}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str | ParallelLayout) -> ParallelLayout:
        """ "2x1" (also "2X1", "2*1") -> ParallelLayout(2, 1)."""
        if isinstance(text, ParallelLayout):
            return text
        match = _LAYOUT_RE.match(str(text))
        if match is None:
            raise ValueError(f"a parallel layout is written 'GxS' (e.g. '2x1', '1x2'), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    def position(self, rank: int) -> tuple[int, int]:
        """(g, s) of a global rank: its group, and its position (SP rank) inside the group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside layout {self.name} (world {self.world_size})")
        return divmod(rank, self.sequence)

    def sp_ranks(self, g: int) -> list[int]:
        """Global ranks of guidance group g (consecutive: one SP group)."""
        return [g * self.sequence + s for s in range(self.sequence)]

    def peer_ranks(self, s: int) -> list[int]:
        """Global ranks at SP position s of every group (the guidance peers that all-gather outputs)."""
        return [g * self.sequence + s for g in range(self.guidance)]

    def describe(self) -> dict[str, Any]:
        """What events report: {"name": "2x1", "guidance": 2, "sequence": 1}."""
        return {"name": self.name, "guidance": self.guidance, "sequence": self.sequence}


def layouts_for(world_size: int) -> list[ParallelLayout]:
    """Every layout of a world, G ascending (1xW first, Wx1 last)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [ParallelLayout(g, world_size // g) for g in range(1, world_size + 1) if world_size % g == 0]


@dataclass(frozen=True)
class LayoutRank:
    """One rank's place in one layout, with the process groups it uses there."""

    layout: ParallelLayout
    rank: int  #: global rank
    guidance_index: int  #: g: which share of the passes this rank's group runs
    sequence_index: int  #: s: this rank's position in its SP group (its rank there)
    sp_group: dist.ProcessGroup | None  #: the S ranks of group g; None when S == 1
    guidance_group: dist.ProcessGroup | None  #: the G peers at position s; None when G == 1

    @property
    def guidance(self) -> int:
        return self.layout.guidance

    @property
    def sequence(self) -> int:
        return self.layout.sequence


@dataclass
class LayoutGroups:
    """The process groups of every layout of a fleet (made once by `build`, collectively)."""

    world_size: int
    rank: int
    ranks: dict[ParallelLayout, LayoutRank] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        world_size: int,
        rank: int,
        *,
        world_group: dist.ProcessGroup | None,
        layouts: Sequence[ParallelLayout] | None = None,
        backend: str | None = None,
    ) -> LayoutGroups:
        """Collective: make the groups of `layouts` (default: every layout of the world).

        Every rank must call it with the same arguments in the same place (setup). `world_group` (the
        fleet's transformer group, spanning every rank; None: the default group) is reused where a layout
        needs the whole world.
        """
        chosen = sorted(set(layouts_for(world_size) if layouts is None else layouts))
        for layout in chosen:
            if layout.world_size != world_size:
                raise ValueError(f"layout {layout} does not fit a fleet of {world_size} ranks")
        out = cls(world_size=world_size, rank=rank)
        if world_group is None and world_size > 1:
            world_group = dist.group.WORLD  # explicit: None in a LayoutRank means "no group" (size 1)
        for layout in chosen:  # same order on every rank: new_group is collective
            g, s = layout.position(rank)
            sp_group = _group_containing(layout.sequence, world_size, world_group, rank, backend, layout.sp_ranks)
            peers = _group_containing(layout.guidance, world_size, world_group, rank, backend, layout.peer_ranks)
            out.ranks[layout] = LayoutRank(layout, rank, g, s, sp_group, peers)
        return out

    @property
    def layouts(self) -> list[ParallelLayout]:
        return sorted(self.ranks)

    def for_layout(self, layout: ParallelLayout | str) -> LayoutRank:
        layout = ParallelLayout.parse(layout)
        view = self.ranks.get(layout)
        if view is None:
            valid = ", ".join(str(x) for x in self.layouts)
            raise ValueError(f"layout {layout} is not available in this fleet of {self.world_size} (valid: {valid})")
        return view


def _group_containing(
    size: int,
    world_size: int,
    world_group: dist.ProcessGroup | None,
    rank: int,
    backend: str | None,
    members: Any,
) -> dist.ProcessGroup | None:
    """This rank's group among the `world_size // size` groups of `size` ranks given by `members(i)`.

    Size 1: None (no communicator). Size W: the fleet's world group. Otherwise every rank creates every
    group (collective) and keeps the one it belongs to.
    """
    if size == 1:
        return None
    if size == world_size:
        return world_group
    mine = None
    for index in range(world_size // size):
        ranks = members(index)
        group = dist.new_group(ranks=ranks, backend=backend)
        if rank in ranks:
            mine = group
    return mine


_RUNNER_ATTRIBUTE = "_ltx_mgpu_layout_groups"


def layout_groups(runner: Any) -> LayoutGroups:
    """Collective (call it in `setup`, on every rank): the groups of every G x S layout of `runner`'s
    fleet, made on the first call and kept on the runner (later calls return them). Kept here rather than
    on `MGPURunner`: the control plane does not know the data plane's layouts."""
    groups = getattr(runner, _RUNNER_ATTRIBUTE, None)
    if groups is None:
        groups = LayoutGroups.build(runner.world_size, runner.rank, world_group=runner.groups.transformer_group)
        setattr(runner, _RUNNER_ATTRIBUTE, groups)
    return groups
