"""`AttentionRouter`: one resident SP-patched model, many SP groups.

The patched attention callables and the SP wrapper hold a *manager* and read its world size, rank,
group, channels and token state on every call. A fleet that switches layouts between stages (stage 1 as
2x1 guidance parallelism on two GPUs, stage 2 as 1x2 SP) must not rebuild or re-patch the model, so the
model holds this router instead: it owns one `AttentionManager` per layout (over that layout's SP group of
this rank; a local one when S = 1) and forwards every attribute to the manager of the *active* layout.
`use(layout)` switches it for a block of code, on every rank at the same point (it decides which
collectives run).

Construction is collective (every rank, same order): each manager's backend factory may be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..sharding.collectives import collective_device
from ..sp.attention import DEFAULT_ALL2ALL_TIMEOUT_S, AttentionManager
from .layout import LayoutGroups, ParallelLayout

__all__ = ["AttentionRouter"]


class AttentionRouter:
    """Layout -> `AttentionManager`, with one active layout; duck-types `AttentionManager`."""

    def __init__(self, managers: Mapping[ParallelLayout, AttentionManager], default: ParallelLayout) -> None:
        if default not in managers:
            raise ValueError(f"default layout {default} has no manager")
        self._managers = dict(managers)
        self.default_layout = default
        self._active = default

    @classmethod
    def build(
        cls,
        groups: LayoutGroups,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        tensor_dtype: torch.dtype,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_ALL2ALL_TIMEOUT_S,
        layouts: Sequence[ParallelLayout] | None = None,
        head_counts: Sequence[int] = (),
    ) -> AttentionRouter:
        """Collective: one manager per layout of `groups` (default all) whose S divides `num_heads` and
        every count in `head_counts` (e.g. the audio heads); the default layout is 1xW (plain SP)."""
        wanted = groups.layouts if layouts is None else sorted(layouts)
        managers: dict[ParallelLayout, AttentionManager] = {}
        for layout in wanted:  # same order on every rank
            s = layout.sequence
            if num_heads % s or any(h % s for h in head_counts):
                continue
            view = groups.for_layout(layout)
            managers[layout] = AttentionManager(
                max_tokens,
                num_heads,
                head_dim,
                tensor_dtype,
                view.sp_group,
                backend=backend,
                device=device,
                timeout_s=timeout_s,
                local=s == 1,
            )
        full = ParallelLayout(1, groups.world_size)
        if full not in managers:
            raise ValueError(f"heads ({num_heads}) must be divisible by world_size ({groups.world_size})")
        return cls(managers, full)

    # ---- switching ---------------------------------------------------------------------------------------
    @property
    def active_layout(self) -> ParallelLayout:
        return self._active

    @property
    def active(self) -> AttentionManager:
        return self._managers[self._active]

    @property
    def layouts(self) -> list[ParallelLayout]:
        return sorted(self._managers)

    def manager(self, layout: ParallelLayout | str) -> AttentionManager:
        layout = ParallelLayout.parse(layout)
        if layout not in self._managers:
            raise ValueError(f"layout {layout} has no attention manager (available: {self.layouts})")
        return self._managers[layout]

    @contextlib.contextmanager
    def use(self, layout: ParallelLayout | str) -> Iterator[AttentionManager]:
        """Route the model's attention through `layout`'s manager inside the block (then restore)."""
        manager = self.manager(layout)
        previous, self._active = self._active, ParallelLayout.parse(layout)
        try:
            yield manager
        finally:
            self._active = previous

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """Every SP size the model may run with (the builder checks head counts against each)."""
        return tuple(sorted({m.world_size for m in self._managers.values()}))

    # ---- the AttentionManager surface, forwarded to the active manager ---------------------------------
    @property
    def world_size(self) -> int:
        return self.active.world_size

    @property
    def rank(self) -> int:
        return self.active.rank

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.active.group

    @property
    def max_tokens(self) -> int:
        return self.active.max_tokens

    @property
    def device(self) -> torch.device:
        return self.active.device

    @property
    def backend_name(self) -> str:
        return self.active.backend_name

    @property
    def comm_ids(self) -> dict[str, int]:
        return self.active.comm_ids

    @property
    def valid_tokens(self) -> int | None:
        return self.active.valid_tokens

    @property
    def mask_audio_padding(self) -> bool:
        return self.active.mask_audio_padding

    @mask_audio_padding.setter
    def mask_audio_padding(self, value: bool) -> None:
        for manager in self._managers.values():
            manager.mask_audio_padding = value

    def set_rank_tokens(self, tokens: Sequence[int], valid_tokens: int | None = None) -> None:
        self.active.set_rank_tokens(tokens, valid_tokens)

    def key_padding_bias(self, total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return self.active.key_padding_bias(total, dtype, device)

    @property
    def all2all_timeout_seconds(self) -> float:
        return self.active.all2all_timeout_seconds

    @all2all_timeout_seconds.setter
    def all2all_timeout_seconds(self, seconds: float) -> None:
        for manager in self._managers.values():
            manager.all2all_timeout_seconds = seconds

    # ---- CUDA graphs -------------------------------------------------------------------------------------
    def capture_blocker(self) -> str | None:
        """Why a forward under the active layout cannot be captured in a CUDA graph (None: it can). A gloo
        SP group moves GPU tensors through host memory, which no graph can contain."""
        group = self.active.group if self.active.world_size > 1 else None
        if group is not None and dist.get_backend(group) != "nccl":
            return f"SP group of layout {self._active} is {dist.get_backend(group)}, not NCCL"
        return None

    def all_agree(self, ok: bool) -> bool:
        """Collective over the active layout's SP group (the ranks that run a forward together): True iff
        every one of them says `ok`. One tiny all-reduce; used once per captured shape."""
        manager = self.active
        if manager.world_size == 1:
            return ok
        device = collective_device(manager.group, manager.device)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=manager.group)
        return bool(int(flag.item()))

    def destroy(self) -> None:
        """Free every manager's channels (idempotent)."""
        for manager in self._managers.values():
            manager.destroy()

    def describe(self) -> dict[str, Any]:
        return {str(k): m.backend_name for k, m in sorted(self._managers.items())}

    def __repr__(self) -> str:
        return f"AttentionRouter(active={self._active}, layouts={[str(x) for x in self.layouts]})"
