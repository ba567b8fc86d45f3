"""What a fleet start took: per-rank timestamps and the split an operator reads (`MGPUController.startup`).

A cold start of a large model has three very different costs, and each has its own fix: spawning ranks
and forming the process group (interpreter and import time, NCCL init), loading weights in `setup()`
(storage and host-to-device bandwidth), and whatever warm-up the caller runs before the first job
(compilation, allocator growth). Every rank stamps wall-clock times (`time.time()`, comparable across the
processes of one machine) at the points below and sends them with its ready message; the controller
keeps them with its own start time.

    started_at ── spawn, imports, init_process_group ──▶ setup_began_at ── setup() ──▶ ready_at
                 └────────────── process_start_s ──────┘                └─ weight_load_s ─┘

The fleet-wide split uses the slowest rank at each point (the fleet is ready when its last rank is). The ready
message also carries what the rank's device offers the memory plan (`ready_stamp`). Imports only the standard
library (`determinism` imports torch when called).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import determinism

__all__ = ["FleetStartup", "RankStartup", "ready_stamp"]


@dataclass(frozen=True)
class RankStartup:
    """One rank's start, stamped by the rank itself (seconds since the epoch)."""

    rank: int
    pid: int
    booted_at: float  #: the rank's entry point runs (interpreter up, torch and the engine imported)
    setup_began_at: float  #: process group and component groups made; `setup()` is called
    ready_at: float  #: `setup()` returned
    #: seconds per named part of `setup()` on this rank, where the runner times them (`setup_phases_s`):
    #: a cold start's cost is spread over model build, weights, decoders and the text encoder, and only
    #: the slowest rank's split says which part to speed up
    setup_phases_s: dict[str, float] = field(default_factory=dict)
    #: what the rank's device offers it once `setup()` returned (free + its allocator's reservation; CUDA
    #: ranks only): the capacity a memory plan checks requests against, known before any job or warm-up runs
    device_memory_bytes: int | None = None
    #: GiB each named part of `setup()` left allocated on the rank's device, where the runner measures it
    #: (`setup_memory_gib`): the resident set as measured, beside the memory plan's figures
    setup_memory_gib: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetStartup:
    """One fleet start: the controller's start time and every rank's stamps; see the module docstring."""

    started_at: float  #: `MGPUController.start()` was called
    ranks: tuple[RankStartup, ...]

    @property
    def setup_began_at(self) -> float:
        return max(r.setup_began_at for r in self.ranks)

    @property
    def ready_at(self) -> float:
        return max(r.ready_at for r in self.ranks)

    @property
    def device_memory_bytes(self) -> int | None:
        """The least any rank's device offers it after setup (None: no rank measured, e.g. CPU ranks)."""
        measured = [r.device_memory_bytes for r in self.ranks if r.device_memory_bytes is not None]
        return min(measured) if measured else None

    @property
    def process_start_s(self) -> float:
        """Spawn to the slowest rank entering `setup()`: processes, imports, process groups."""
        return max(0.0, self.setup_began_at - self.started_at)

    @property
    def weight_load_s(self) -> float:
        """The slowest rank entering `setup()` to the slowest rank leaving it: model load."""
        return max(0.0, self.ready_at - self.setup_began_at)

    @property
    def ready_s(self) -> float:
        return max(0.0, self.ready_at - self.started_at)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: the split (rounded to ms) plus the raw per-rank stamps."""
        return {
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "process_start_s": round(self.process_start_s, 3),
            "weight_load_s": round(self.weight_load_s, 3),
            "ready_s": round(self.ready_s, 3),
            "ranks": [asdict(r) for r in sorted(self.ranks, key=lambda r: r.rank)],
        }


def ready_stamp(rank: int, runner: Any, device: Any, booted_at: float, setup_began_at: float) -> RankStartup:
    """This rank's ready message, made once `setup()` returned. Its device memory is what the device offers
    (`determinism.offered_memory_bytes`): the memory plan's capacity, a constant of the GPU model in the
    deterministic mode (free memory varies between fleet builds and would change the plan)."""
    offered = determinism.offered_memory_bytes(device)
    return RankStartup(
        rank,
        os.getpid(),
        booted_at,
        setup_began_at,
        time.time(),
        _setup_phases(runner),
        offered,
        _setup_phases(runner, "setup_memory_gib"),
    )


def _setup_phases(runner: Any, attribute: str = "setup_phases_s") -> dict[str, float]:
    """The runner's optional per-part setup figures (seconds, device GiB), kept only if JSON-safe."""
    phases = getattr(runner, attribute, None)
    if not isinstance(phases, dict):
        return {}
    return {str(k): round(float(v), 3) for k, v in phases.items() if isinstance(v, int | float)}
