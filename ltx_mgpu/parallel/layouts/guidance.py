"""Guidance parallelism: the P passes of one guided denoising step on G rank groups at once.

Under layout G x S (see `layout.py`) group g runs its share of the passes, batched, with SP over its S
ranks (the resident model's attention follows the layout through `AttentionRouter`); then the guidance
peers (same SP position in every group) all-gather the denoised outputs, once per step, so every rank
holds all P outputs and runs the guider combine itself. Every rank computes the combine from the same
bytes, so the ranks stay bit-identical without another collective.

Shares: contiguous, the first P % G groups take one pass more (P=3 over G=2: [2, 1]; P=4 over G=3:
[2, 1, 1]). Uneven shares are *gathered*, not padded with dummy passes: every group sends ceil(P/G) rows
to the fixed-size all-gather (graph-friendly, one collective); a short group's spare rows are zeros that
cost no compute and are dropped. A group with no passes (an override with G > P) runs no forward.

`GuidanceParallelPasses` has the signature of the runner's `run_passes(x0, video_state, audio_state,
sigma, passes, max_batch)` and wraps it (`base_run`), so the pipeline's guider code is unchanged and this
package needs nothing from the runners.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..sharding.collectives import all_gather_tokens
from ..sharding.partition import padded_token_count
from ..sp.wrapper import check_token_budget
from .cost_model import LayoutChoice
from .layout import LayoutGroups, LayoutRank, ParallelLayout
from .router import AttentionRouter

__all__ = ["GuidanceParallelPasses", "gather_pass_outputs", "run_guidance_parallel", "split_passes"]

Outputs = list[tuple[torch.Tensor, torch.Tensor | None]]
RunPasses = Callable[[Any, Any, Any, torch.Tensor, Sequence[Any], int], Outputs]


def split_passes(passes: int, groups: int) -> list[range]:
    """Contiguous pass indices per group; the first `passes % groups` groups take one more."""
    if groups < 1 or passes < 0:
        raise ValueError(f"cannot split {passes} passes over {groups} groups")
    base, extra = divmod(passes, groups)
    out, start = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _row_specs(video_state: Any, audio_state: Any) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """(shape, dtype) of one pass's denoised video and audio (what `X0Model` returns: the latents')."""
    specs: list[tuple[tuple[int, ...], torch.dtype] | None] = []
    for state in (video_state, audio_state):
        latent = None if state is None else state.latent
        specs.append(None if latent is None else ((1, *latent.shape[1:]), latent.dtype))
    return specs


def _nbytes(spec: tuple[tuple[int, ...], torch.dtype] | None) -> int:
    if spec is None:
        return 0
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def gather_pass_outputs(
    mine: Outputs,
    shares: list[range],
    group_index: int,
    specs: list[tuple[tuple[int, ...], torch.dtype] | None],
    group: Any,
    device: torch.device,
    buffers: dict[tuple[int, int], torch.Tensor] | None = None,
) -> Outputs:
    """One all-gather over the guidance peers: every group's outputs -> all P outputs in pass order.

    Rows travel as raw bytes (video and audio of a pass in one row), ceil(P/G) rows per group. `buffers`:
    send buffers kept from step to step by shape (a short group's spare rows are sent but never read, so
    they need no zeroing: one allocation and one memset less per step)."""
    rows = max(len(r) for r in shares)
    vbytes, abytes = _nbytes(specs[0]), _nbytes(specs[1])
    width = vbytes + abytes
    send = None if buffers is None else buffers.get((rows, width))
    if send is None or send.device != torch.device(device):
        send = torch.empty((1, rows, width), dtype=torch.uint8, device=device)
        if buffers is not None:
            buffers.clear()  # one shape per stage: keep only the current one
            buffers[(rows, width)] = send
    for j, (dv, da) in enumerate(mine):
        send[0, j, :vbytes] = dv.contiguous().reshape(-1).view(torch.uint8)
        if abytes:
            send[0, j, vbytes:] = da.contiguous().reshape(-1).view(torch.uint8)
    gathered = all_gather_tokens(send, group)[0]  # (G * rows, width), group (rank) order = g order
    out: Outputs = []
    for g, share in enumerate(shares):
        for j in range(len(share)):
            if g == group_index:
                out.append(mine[j])  # this group's own outputs: no round trip through bytes
                continue
            row = gathered[g * rows + j]
            out.append((_unpack(row[:vbytes], specs[0]), _unpack(row[vbytes:], specs[1]) if abytes else None))
    return out


def _unpack(raw: torch.Tensor, spec: tuple[tuple[int, ...], torch.dtype] | None) -> torch.Tensor:
    assert spec is not None
    shape, dtype = spec
    return raw.view(dtype).view(shape)


def run_guidance_parallel(
    view: LayoutRank,
    router: AttentionRouter | None,
    base_run: RunPasses,
    x0: Any,
    video_state: Any,
    audio_state: Any,
    sigma: torch.Tensor,
    passes: Sequence[Any],
    max_batch: int,
    *,
    max_tokens: int,
    device: torch.device,
    buffers: dict[tuple[int, int], torch.Tensor] | None = None,
) -> Outputs:
    """The passes of one step under `view.layout`, on every rank; returns all P outputs in pass order."""
    layout = view.layout
    tokens = int(video_state.latent.shape[1])
    # Every rank raises the same budget error before any collective (T and S are the same everywhere).
    check_token_budget(padded_token_count(tokens, layout.sequence), 1, max_tokens)
    rows_fit = max(1, max_tokens // padded_token_count(tokens, layout.sequence))
    batch = max(1, min(int(max_batch), rows_fit))
    if sigma.device != device:
        sigma = sigma.to(device, non_blocking=True)  # pageable source: staged at once, no stream sync
    shares = split_passes(len(passes), layout.guidance)
    share = shares[view.guidance_index]
    mine: Outputs = []
    if len(share):
        with router.use(layout) if router is not None else contextlib.nullcontext():
            mine = base_run(x0, video_state, audio_state, sigma, [passes[i] for i in share], batch)
    if layout.guidance == 1:
        return mine
    specs = _row_specs(video_state, audio_state)
    return gather_pass_outputs(mine, shares, view.guidance_index, specs, view.guidance_group, device, buffers)


class GuidanceParallelPasses:
    """`run_passes` of a stage, run under the stage's layout (chosen per token/pass count, memoized).

    Args:
        groups: the fleet's `LayoutGroups` (made once at setup).
        router: the resident model's `AttentionRouter` (None for a model without SP patches: every layout
            with S > 1 then needs one, so only Gx1 layouts work).
        base_run: the pipeline's `run_passes(x0, video_state, audio_state, sigma, passes, max_batch)`.
        choose: `(tokens, passes) -> LayoutChoice`, e.g. `partial(policy.choose, "stage1")`; or a fixed
            layout.
        max_tokens: the SP token budget (`sp_max_tokens`).
        device: this rank's device.
    """

    def __init__(
        self,
        groups: LayoutGroups,
        router: AttentionRouter | None,
        base_run: RunPasses,
        *,
        choose: Callable[[int, int], LayoutChoice] | ParallelLayout | str,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.groups = groups
        self.router = router
        self.base_run = base_run
        self._choose = choose
        self.max_tokens = int(max_tokens)
        self.device = torch.device(device)
        self._plans: dict[tuple[int, int], LayoutChoice] = {}
        self._send_buffers: dict[tuple[int, int], torch.Tensor] = {}  # the all-gather's, reused every step

    def plan(self, tokens: int, passes: int) -> LayoutChoice:
        """The layout for a step of `passes` passes over `tokens` video tokens (the same on every rank)."""
        key = (int(tokens), int(passes))
        choice = self._plans.get(key)
        if choice is None:
            if callable(self._choose):
                choice = self._choose(*key)
            else:
                choice = LayoutChoice(ParallelLayout.parse(self._choose), "override", {})
            self.groups.for_layout(choice.layout)  # raises if the fleet has no such layout
            self._plans[key] = choice
        return choice

    def __call__(
        self,
        x0: Any,
        video_state: Any,
        audio_state: Any,
        sigma: torch.Tensor,
        passes: Sequence[Any],
        max_batch: int,
    ) -> Outputs:
        choice = self.plan(int(video_state.latent.shape[1]), len(passes))
        return run_guidance_parallel(
            self.groups.for_layout(choice.layout),
            self.router,
            self.base_run,
            x0,
            video_state,
            audio_state,
            sigma,
            passes,
            max_batch,
            max_tokens=self.max_tokens,
            device=self.device,
            buffers=self._send_buffers,
        )
