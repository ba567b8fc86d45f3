"""Which request sizes' CUDA graphs a fleet keeps between jobs, so their private pools never crowd out a job the
memory plan admitted.

A captured forward's pool stays until its graphs are dropped, and the plan (`ltx_mgpu.spec.memory_plan`) counts only
the pools of the job it plans. A fleet serving 768x512 and then 1536x1024 would otherwise hold both sizes' pools in
the second job: on one H100 that ran admitted fp8 jobs out of memory (docs/memory.md, "Per card"). Every rank
keeps the same ledger from the same plan, so every rank drops its graphs at the same job (the captures that
follow agree over a collective and must be entered by all ranks).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GraphRoom"]


@dataclass
class GraphRoom:
    """The sizes whose graphs are held, each with the pools the plan predicted for it (GiB a rank)."""

    held: dict[Hashable, float] = field(default_factory=dict)

    def before_job(self, size: Hashable, plan: Mapping[str, Any] | None) -> bool:
        """A job of `size` with the worker's plan (`MemoryPlan.job_kwargs()`) is about to run: True when the other
        sizes' graphs must be dropped first, because their pools exceed the room the plan leaves
        (`graph_room_gib`; none given: no limit, keep them). The ledger then holds `size` too (alone after a drop)."""
        plan = plan or {}
        room = plan.get("graph_room_gib")
        others = sum(gib for key, gib in self.held.items() if key != size)
        drop = room is not None and others > float(room)
        if drop:
            self.held.clear()
        self.held[size] = float(plan.get("graph_pool_gib") or 0.0)
        return drop

    def clear(self) -> None:
        """The graphs were dropped (all of them, for any reason)."""
        self.held.clear()
