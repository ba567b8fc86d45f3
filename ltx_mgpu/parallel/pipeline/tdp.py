"""Tiled data parallelism (TDP): every rank runs the *whole* transformer on some tiles of the video latent
grid; the tiles' outputs are blended with trapezoidal masks and summed across ranks with one all-reduce.

What it is for, and what it is not:
- An upscaling/refinement stage (LTX-2's stage 2 at 2x resolution): per-tile attention cost drops
  quadratically and each tile is an in-distribution resolution for the model. It is *not* faithful (a tile
  does not see the rest of the video) and it must not be the first stage from pure noise: tiles would
  diverge. Tiles drift more with a higher first sigma, hence the runners' reduced stage-2 schedule.
- Audio is run untiled with every tile forward (so the video tiles keep their audio cross-attention) and
  the per-tile audio outputs are averaged: that is *not* a meaningful audio latent. Pipelines keep the
  audio of the previous (SP) stage.

Contract (per forward, every rank of `group`, same order):
1. The generated tokens form a (frames, height, width) latent grid (`set_latent_shape` / the
   `latent_shape` context manager says which); tokens after them are conditioning tokens (keyframes).
2. Tiles are the product of per-axis intervals (`tiling.py`: `TileCountConfig` or `BalancedTiling`), numbered in
   (frame, height, width) order and dealt round-robin: tile `i` runs on rank `i % world_size`. There must
   be at least as many tiles as ranks; otherwise `ValueError` on every rank before any collective.
3. A tile keeps its generated tokens plus every conditioning token whose [start, end) box overlaps the
   tile's box on all three axes, or whose time start is negative (reference tokens, kept by every tile).
   With `normalize_positions` the tile's positions are shifted so its generated tokens start at zero on
   every axis (extents preserved): each tile looks like a small video of its own.
4. Generated outputs are weighted by the tile's separable trapezoidal mask (masks of all tiles sum to one
   at every token: `blend_weights` proves it), conditioning outputs by 1 / (number of tiles keeping that
   token); a float32 accumulator is all-reduced once (audio rides in the same buffer). At 768x512x121 the
   stage-2 latent is 6,144 tokens x 128 channels: 3 MB in float32, a few microseconds over NVLink, so the
   exact float32 sum is kept. Under deterministic algorithms (`ltx_mgpu.control.determinism`) the buffers
   are all-gathered and added in rank order instead (`collectives.ordered_sum`): the same bits whatever
   reduction algorithm the communication library picks.
5. Per job, not per step: what a tile needs besides its latent (token indices, blend weights, positions,
   attention mask, and through `hoist.ForwardHoister` its RoPE tables and mask bias) is made on the first
   step and reused while the inputs are the same tensors, so a later step makes no host sync and no
   host->device copy (tests/test_tdp_gpu.py checks it with `set_sync_debug_mode("error")`).

Errors are raised identically on every rank before any collective (symmetric, recoverable under the
controller): too few tiles for the ranks, a tile count an axis cannot hold, overlaps that would make three
tiles meet, or a forward whose token count does not match the declared latent shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..graphs.hoist import ForwardHoister
from ..sharding.collectives import needs_host_staging, ordered_sum
from .tiling import BalancedTiling, TdpTile, TileCountConfig, Tiling, build_tiles

__all__ = ["TiledDataParallelBuilder", "TiledDataParallelModelWrapper", "shared_weights_model"]

# =========================================================================================================
# The wrapper
# =========================================================================================================


def _tokenwise(value: Any, total: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == total


class TiledDataParallelModelWrapper(torch.nn.Module):
    """Runs `model` (an `LTXModel`, velocity outputs) tile by tile; see the module docstring.

    Args:
        model: the transformer; its attention must be local (not SP-patched): use `shared_weights_model`
            to get an unpatched sibling of an SP model that shares its weights.
        tiling: `TileCountConfig` (fixed counts) or `BalancedTiling` (grid chosen per geometry).
        group: the process group the tiles are dealt over (None = default group).
        normalize_positions: shift each tile's positions so its generated tokens start at zero.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tiling: Tiling,
        group: dist.ProcessGroup | None = None,
        normalize_positions: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.tiling = tiling
        self.group = group
        self.normalize_positions = normalize_positions
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        fixed = tiling.num_tiles if isinstance(tiling, TileCountConfig | BalancedTiling) else None
        if fixed is not None and fixed < self.world_size:
            raise ValueError(
                f"tiled data parallel needs at least as many tiles as ranks: {fixed} tile(s) for world size "
                f"{self.world_size}. Raise the tile counts."
            )
        self._grid: tuple[int, int, int] | None = None
        self._cached_plan: _Plan | None = None
        # ltx-core's preprocessors rebuild RoPE tables (host->device copies) and masks every forward: the
        # hoister takes them out, per tile and job (a model without them, e.g. a test double, is left alone)
        self.hoister = ForwardHoister(model) if hasattr(model, "video_args_preprocessor") else None

    # ---- geometry of the current stage -------------------------------------------------------------
    def set_latent_shape(self, shape: Any) -> None:
        """Declare the generated-token grid: a `VideoLatentShape` or (frames, height, width)."""
        if hasattr(shape, "frames"):
            self._grid = (int(shape.frames), int(shape.height), int(shape.width))
        else:
            f, h, w = (int(x) for x in shape)
            self._grid = (f, h, w)
        self.tiles_for(self._grid)  # validate now, on every rank alike
        self._cached_plan = None  # a new job: its positions are a new tensor anyway; free the old plan

    @contextlib.contextmanager
    def latent_shape(self, shape: Any) -> Iterator[TiledDataParallelModelWrapper]:
        previous = self._grid
        self.set_latent_shape(shape)
        try:
            yield self
        finally:
            self._grid = previous

    def tiles_for(self, grid: Sequence[int]) -> list[TdpTile]:
        tiles = build_tiles(grid, self.tiling)
        if len(tiles) < self.world_size:
            raise ValueError(
                f"tiled data parallel needs at least as many tiles as ranks: {len(tiles)} tile(s) for world "
                f"size {self.world_size}. Raise the tile counts."
            )
        return tiles

    # ---- forward ------------------------------------------------------------------------------------
    def forward(
        self, video: Any | None, audio: Any | None, perturbations: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if video is None:
            return self.model(video, audio, perturbations)
        if self._grid is None:
            raise RuntimeError("TiledDataParallelModelWrapper: call set_latent_shape() before the forward")
        grid = self._grid
        n_gen = grid[0] * grid[1] * grid[2]
        total = int(video.latent.shape[1])
        if total < n_gen:
            raise ValueError(f"video has {total} tokens, fewer than the declared {grid} grid ({n_gen})")
        plan = self._plan(video, audio, grid, total)
        b, _, c = video.latent.shape
        acc_v = torch.zeros((b, total, c), dtype=torch.float32, device=video.latent.device)
        # Every rank owns >= 1 tile (checked above), so every rank produces an audio output iff audio is given:
        # the flat buffer has the same size everywhere.
        acc_a: torch.Tensor | None = None
        if self.hoister is not None:
            perturbations = self.hoister.perturbations(perturbations)
        for owned in plan.tiles:
            tile_video = self._slice(video, owned, total)
            if owned.geometry is None:
                vx, ax = self.model(tile_video, audio, perturbations)
            else:  # RoPE, masks and their host->device copies made once per job (parallel/graphs/hoist.py)
                assert self.hoister is not None
                with self.hoister.bind(video=owned.geometry, audio=plan.audio_geometry):
                    vx, ax = self.model(tile_video, audio, perturbations)
            acc_v.index_add_(1, owned.idx, vx.float() * owned.weights[None, :, None])
            if ax is not None:
                acc_a = ax.float() if acc_a is None else acc_a + ax.float()
        flat = acc_v.reshape(-1) if acc_a is None else torch.cat([acc_v.reshape(-1), acc_a.reshape(-1)])
        flat = self._all_reduce(flat)
        vx_out = flat[: acc_v.numel()].view_as(acc_v).to(video.latent.dtype)
        ax_out = None
        if acc_a is not None:
            ax_out = (flat[acc_v.numel() :].view_as(acc_a) / plan.num_tiles).to(audio.latent.dtype)
        return vx_out, ax_out

    def _plan(self, video: Any, audio: Any | None, grid: tuple[int, int, int], total: int) -> _Plan:
        """This rank's tiles with their token indices, blend weights, (normalised) positions, attention masks
        and hoisted geometry (RoPE tables, mask bias) on the device, made once per geometry and input tensors:
        the steps of a stage reuse them, so a step makes no host->device copy and, with conditioning tokens,
        no device->host read of the positions. The plan holds the tensors its key names by address, so their
        memory cannot be reused by another tensor while it is cached."""
        positions, mask = video.positions, getattr(video, "attention_mask", None)
        audio_positions = None if audio is None else audio.positions
        held = (positions, mask, audio_positions)
        key = (
            grid,
            total,
            str(video.latent.device),
            video.latent.dtype,
            *((None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()))) for t in held),
        )
        cached = self._cached_plan
        if cached is not None and cached.key == key and all(a is b for a, b in zip(cached.held, held, strict=True)):
            return cached
        tiles = self.tiles_for(grid)
        n_gen = grid[0] * grid[1] * grid[2]
        keep, counts = self._conditioning_plan(positions, grid, tiles, n_gen, total)
        device = video.latent.device
        owned = []
        for tile in tiles[self.rank :: self.world_size]:
            idx = torch.cat([tile.token_indices(grid), keep[tile.index] + n_gen]).to(device)
            weights = torch.cat([tile.mask(), 1.0 / counts[keep[tile.index]]]).to(device)
            tile_positions = positions[:, :, idx]
            if self.normalize_positions:
                gen = positions[:, :, :n_gen]
                gen = gen.reshape(gen.shape[0], gen.shape[1], *grid, gen.shape[-1])
                f, h, w = (slice(a.start, a.end) for a in tile.axes)
                origin = gen[:, :, f, h, w, 0].amin(dim=(2, 3, 4))  # (B, 3): the tile's start per axis
                tile_positions = tile_positions - origin[:, :, None, None].to(positions.dtype)
            tile_mask = None
            if isinstance(mask, torch.Tensor):
                if not (mask.dim() == 3 and mask.shape[-1] == total and mask.shape[-2] == total):
                    raise ValueError(f"TDP expects a (B, {total}, {total}) attention mask, got {tuple(mask.shape)}")
                tile_mask = mask[:, idx][:, :, idx]
            geometry = None
            if self.hoister is not None and "video" in self.hoister.preprocessors:
                probe = dataclasses.replace(
                    video, latent=video.latent[:, idx], positions=tile_positions, attention_mask=tile_mask
                )
                geometry = self.hoister.compute_geometry("video", probe)
            owned.append(_OwnedTile(tile, idx, weights, tile_positions, tile_mask, geometry))
        audio_geometry = None
        if audio is not None and self.hoister is not None and "audio" in self.hoister.preprocessors:
            audio_geometry = self.hoister.compute_geometry("audio", audio)
        self._cached_plan = _Plan(key, held, owned, len(tiles), audio_geometry)
        return self._cached_plan

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return flat
        if torch.are_deterministic_algorithms_enabled():
            return ordered_sum(flat, self.group)
        staged = needs_host_staging(self.group, flat.device)
        buf = flat.cpu() if staged else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(flat.device) if staged else buf

    @staticmethod
    def _conditioning_plan(
        positions: torch.Tensor, grid: Sequence[int], tiles: list[TdpTile], n_gen: int, total: int
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Which conditioning tokens each tile keeps (indices relative to `n_gen`) and how many tiles keep
        each (host tensors). Positions of batch row 0 decide (every row of a batch shares positions); only
        a video with conditioning tokens reads them back from the device."""
        n_cond = total - n_gen
        if n_cond == 0:
            return {tile.index: torch.zeros(0, dtype=torch.long) for tile in tiles}, torch.ones(0)
        pos = positions[0].float().cpu()  # (3, T, 2): [start, end) per axis
        gen = pos[:, :n_gen].reshape(3, *(int(g) for g in grid), 2)
        cond = pos[:, n_gen:]  # (3, n_cond, 2)
        keep: dict[int, torch.Tensor] = {}
        counts = torch.zeros(n_cond, dtype=torch.float32)
        for tile in tiles:
            box = _tile_box(gen, tile)  # (3, 2)
            overlaps = ((cond[..., 0] < box[:, 1:2]) & (cond[..., 1] > box[:, 0:1])).all(dim=0)
            kept = overlaps | (cond[0, :, 0] < 0)
            keep[tile.index] = torch.nonzero(kept).reshape(-1)
            counts += kept.float()
        return keep, counts.clamp(min=1.0)

    def _slice(self, video: Any, owned: _OwnedTile, total: int) -> Any:
        idx = owned.idx
        changes: dict[str, Any] = {"latent": video.latent[:, idx], "positions": owned.positions}
        for name in ("timesteps", "keyframes_mask", "segment_ids"):
            value = getattr(video, name, None)
            if _tokenwise(value, total):
                changes[name] = value[:, idx]
        if isinstance(getattr(video, "attention_mask", None), torch.Tensor):
            changes["attention_mask"] = owned.attention_mask
        return dataclasses.replace(video, **changes)


@dataclasses.dataclass(frozen=True)
class _OwnedTile:
    """A tile this rank runs, with what its forward needs on the device."""

    tile: TdpTile
    idx: torch.Tensor  #: token indices into the full video: generated, then kept conditioning tokens
    weights: torch.Tensor  #: float32 blend weight per index
    positions: torch.Tensor  #: the tile's positions (normalised when the wrapper says so)
    attention_mask: torch.Tensor | None  #: the tile's (B, t, t) mask, when the video has one
    geometry: Any  #: the tile's `hoist.ModalityGeometry` (None for a model without ltx-core preprocessors)


@dataclasses.dataclass(frozen=True)
class _Plan:
    key: tuple[Any, ...]
    held: tuple[torch.Tensor | None, ...]  #: held so the memory behind `key`'s data pointers stays theirs
    tiles: list[_OwnedTile]
    num_tiles: int
    audio_geometry: Any  #: the audio's `hoist.ModalityGeometry`, or None


def _tile_box(gen: torch.Tensor, tile: TdpTile) -> torch.Tensor:
    """(3, 2) [start, end) of a tile's generated tokens per axis, in position units."""
    f, h, w = (slice(a.start, a.end) for a in tile.axes)
    part = gen[:, f, h, w]  # (3, tf, th, tw, 2)
    return torch.stack([part[..., 0].amin(dim=(1, 2, 3)), part[..., 1].amax(dim=(1, 2, 3))], dim=-1)


# =========================================================================================================
# Builders
# =========================================================================================================


def _check_materialized(model: torch.nn.Module, what: str) -> None:
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise RuntimeError(
            f"{what}: {len(meta)} tensors are still on the meta device after loading (first: {meta[:3]}); the "
            "checkpoint lacks them"
        )


def shared_weights_model(builder: Any, source: torch.nn.Module, *, drop_module_ops: Sequence[str] = ()) -> Any:
    """A new model from `builder`'s config and module ops whose parameters and buffers *are* `source`'s.

    Used to run one resident set of weights under two execution modes (an SP-patched model for stage 1,
    a plain one for tiled stage 2) without a second copy. Module ops named in `drop_module_ops` (e.g. the
    SP attention patch) are not applied. In-place weight updates (LoRA swaps) show in both models.
    """
    ops = tuple(op for op in builder.module_ops if op.name not in set(drop_module_ops))
    sibling = builder.meta_model(builder.model_config(), ops)
    state = source.state_dict(keep_vars=False)  # detached tensors sharing storage with `source`
    sibling.load_state_dict(state, strict=True, assign=True)
    for name, buf in source.named_buffers():  # non-persistent buffers are not in the state dict
        _set_tensor(sibling, name, buf)
    _check_materialized(sibling, "shared_weights_model")
    return sibling.eval().requires_grad_(False)


def _set_tensor(module: torch.nn.Module, dotted: str, value: torch.Tensor) -> None:
    parent, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    if leaf in owner._buffers:
        owner._buffers[leaf] = value


class TiledDataParallelBuilder:
    """Builds `TiledDataParallelModelWrapper` around a model from a `SingleGPUModelBuilder`.

    `build(device, dtype)` loads the checkpoint (failing clearly if anything stays on meta);
    `build_sharing(source)` instead wraps an unpatched sibling of an already-built model that shares its
    weights (one resident copy for SP stage 1 and TDP stage 2).
    """

    def __init__(
        self,
        inner: Any,
        *,
        tiling: Tiling,
        group: dist.ProcessGroup | None = None,
        normalize_positions: bool = True,
        registry: Any = None,
    ) -> None:
        from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

        if not isinstance(inner, SingleGPUModelBuilder):
            raise TypeError(f"TiledDataParallelBuilder wraps a SingleGPUModelBuilder, got {type(inner).__name__}")
        if registry is not None:
            inner = dataclasses.replace(inner, registry=registry)
        self.inner = inner
        self.tiling = tiling
        self.group = group
        self.normalize_positions = normalize_positions
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if tiling.num_tiles < world:  # up front: the builder is made in setup, on every rank alike
            raise ValueError(
                f"tiled data parallel needs at least as many tiles as ranks: {tiling.num_tiles} tile(s) for "
                f"world size {world}. Raise the tile counts."
            )

    def model_config(self) -> dict:
        return self.inner.model_config()

    def _wrap(self, model: torch.nn.Module) -> TiledDataParallelModelWrapper:
        return TiledDataParallelModelWrapper(
            model, tiling=self.tiling, group=self.group, normalize_positions=self.normalize_positions
        )

    def build(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TiledDataParallelModelWrapper:
        model = self.inner.build(device=torch.device(device), dtype=dtype)
        _check_materialized(model, f"checkpoint {self.inner.model_path!r}")
        return self._wrap(model.eval().requires_grad_(False))

    def build_sharing(
        self, source: torch.nn.Module, *, drop_module_ops: Sequence[str] = ()
    ) -> TiledDataParallelModelWrapper:
        return self._wrap(shared_weights_model(self.inner, source, drop_module_ops=drop_module_ops))
