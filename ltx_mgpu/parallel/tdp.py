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
2. Tiles are the product of per-axis intervals (`TileCountConfig` or `BalancedTiling`), numbered in
   (frame, height, width) order and dealt round-robin: tile `i` runs on rank `i % world_size`. There must
   be at least as many tiles as ranks; otherwise `ValueError` on every rank before any collective.
3. A tile keeps its generated tokens plus every conditioning token whose [start, end) box overlaps the
   tile's box on all three axes, or whose time start is negative (reference tokens, kept by every tile).
   With `normalize_positions` the tile's positions are shifted so its generated tokens start at zero on
   every axis (extents preserved): each tile looks like a small video of its own.
4. Generated outputs are weighted by the tile's separable trapezoidal mask (masks of all tiles sum to one
   at every token: `blend_weights` proves it), conditioning outputs by 1 / (number of tiles keeping that
   token); a float32 accumulator is all-reduced once (audio rides in the same buffer).

Errors are raised identically on every rank before any collective (symmetric, recoverable under the
controller): too few tiles for the ranks, a tile count an axis cannot hold, overlaps that would make three
tiles meet, or a forward whose token count does not match the declared latent shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import needs_host_staging

__all__ = [
    "AxisInterval",
    "BalancedTiling",
    "DimensionTiling",
    "TdpTile",
    "TileCountConfig",
    "TiledDataParallelBuilder",
    "TiledDataParallelModelWrapper",
    "blend_weights",
    "build_tiles",
    "shared_weights_model",
    "split_axis",
    "trapezoid",
]

_AXES = ("frames", "height", "width")


# =========================================================================================================
# Tiling geometry (pure functions; shared with the distributed VAE decoder)
# =========================================================================================================


@dataclass(frozen=True)
class AxisInterval:
    """One tile's extent along one axis: [start, end) plus the blend ramps at each side."""

    start: int
    end: int
    left_ramp: int  #: ramp length at the start (0 for the first tile)
    right_ramp: int  #: ramp length at the end (0 for the last tile)

    @property
    def size(self) -> int:
        return self.end - self.start


def trapezoid(size: int, left_ramp: int, right_ramp: int) -> torch.Tensor:
    """float32 (size,) mask: 1 in the middle, linear ramps at the ends that exclude 0 and 1.

    A right ramp of length r on one tile and a left ramp of length r on its neighbour, over the same r
    positions, sum to exactly one: (k+1)/(r+1) + (1 - (k+1)/(r+1)).
    """
    if size <= 0 or left_ramp < 0 or right_ramp < 0 or left_ramp + right_ramp > size:
        raise ValueError(f"invalid trapezoid: size {size}, ramps {left_ramp}/{right_ramp}")
    mask = torch.ones(size, dtype=torch.float32)
    if left_ramp:
        mask[:left_ramp] = torch.arange(1, left_ramp + 1, dtype=torch.float32) / (left_ramp + 1)
    if right_ramp:
        mask[size - right_ramp :] = 1.0 - torch.arange(1, right_ramp + 1, dtype=torch.float32) / (right_ramp + 1)
    return mask


def split_axis(length: int, num_tiles: int, overlap: int, *, axis: str = "axis") -> list[AxisInterval]:
    """Split [0, length) into exactly `num_tiles` intervals whose neighbours overlap by exactly `overlap`.

    Sizes differ by at most one. Every tile must be at least `2 * overlap` long (and at least 1), so no
    point is covered by three tiles and the trapezoidal masks form a partition of unity; otherwise
    `ValueError` saying what would fit.
    """
    if num_tiles < 1:
        raise ValueError(f"{axis}: num_tiles must be >= 1, got {num_tiles}")
    if overlap < 0:
        raise ValueError(f"{axis}: overlap must be >= 0, got {overlap}")
    if num_tiles == 1:
        return [AxisInterval(0, length, 0, 0)]
    covered = length + (num_tiles - 1) * overlap
    smallest = covered // num_tiles
    if smallest < max(1, 2 * overlap):
        raise ValueError(
            f"cannot split {length} latent {axis} into {num_tiles} tiles with overlap {overlap}: tiles would be "
            f"{smallest} long, need >= {max(1, 2 * overlap)}. Use fewer tiles or a smaller overlap."
        )
    sizes = [smallest + (1 if i < covered % num_tiles else 0) for i in range(num_tiles)]
    out, start = [], 0
    for i, size in enumerate(sizes):
        left = overlap if i > 0 else 0
        right = overlap if i < num_tiles - 1 else 0
        out.append(AxisInterval(start, start + size, left, right))
        start += size - overlap
    assert out[-1].end == length  # construction invariant, not input validation
    return out


@dataclass(frozen=True)
class DimensionTiling:
    """Tile count and overlap (in latent units) along one axis."""

    num_tiles: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        if int(self.num_tiles) < 1:
            raise ValueError(f"num_tiles must be >= 1, got {self.num_tiles}")
        if int(self.overlap) < 0:
            raise ValueError(f"overlap must be >= 0, got {self.overlap}")


@dataclass(frozen=True)
class TileCountConfig:
    """A fixed tile grid: counts and overlaps per axis (frames, height, width), in latent units."""

    frames: DimensionTiling = DimensionTiling()
    height: DimensionTiling = DimensionTiling()
    width: DimensionTiling = DimensionTiling()

    @property
    def num_tiles(self) -> int:
        return self.frames.num_tiles * self.height.num_tiles * self.width.num_tiles

    def intervals(self, grid: Sequence[int]) -> tuple[list[AxisInterval], ...]:
        """Per-axis intervals for a (frames, height, width) latent grid."""
        dims = (self.frames, self.height, self.width)
        return tuple(
            split_axis(int(n), d.num_tiles, d.overlap, axis=a) for n, d, a in zip(grid, dims, _AXES, strict=True)
        )


@dataclass(frozen=True)
class BalancedTiling:
    """`num_tiles` spatial tiles (height x width), the grid chosen per geometry.

    Among the factor pairs (h, w) with h * w == num_tiles that can split the grid, picks the one whose
    tiles are closest to square (ties: fewer tiles along height), so a 16:9 video gets more columns than
    rows. The reference always gives height the smaller factor regardless of the aspect ratio.
    """

    num_tiles: int
    overlap: int = 2

    def __post_init__(self) -> None:
        if int(self.num_tiles) < 1:
            raise ValueError(f"num_tiles must be >= 1, got {self.num_tiles}")
        if int(self.overlap) < 0:
            raise ValueError(f"overlap must be >= 0, got {self.overlap}")

    def grid_for(self, grid: Sequence[int]) -> TileCountConfig:
        _, height, width = (int(x) for x in grid)
        best: tuple[float, int, TileCountConfig] | None = None
        errors = []
        for h in range(1, self.num_tiles + 1):
            if self.num_tiles % h:
                continue
            w = self.num_tiles // h
            cfg = TileCountConfig(
                height=DimensionTiling(h, self.overlap if h > 1 else 0),
                width=DimensionTiling(w, self.overlap if w > 1 else 0),
            )
            try:
                cfg.intervals(grid)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            th, tw = height / h, width / w
            score = (max(th / tw, tw / th), h)
            if best is None or score < best[:2]:
                best = (*score, cfg)
        if best is None:
            raise ValueError(
                f"cannot split a {height}x{width} latent grid into {self.num_tiles} tiles with overlap "
                f"{self.overlap}: {errors[0] if errors else 'no factorisation'}"
            )
        return best[2]

    def intervals(self, grid: Sequence[int]) -> tuple[list[AxisInterval], ...]:
        return self.grid_for(grid).intervals(grid)


Tiling = TileCountConfig | BalancedTiling


@dataclass(frozen=True)
class TdpTile:
    """One tile of the latent grid: its per-axis intervals (frames, height, width)."""

    index: int
    axes: tuple[AxisInterval, AxisInterval, AxisInterval]

    def token_indices(self, grid: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
        """Flat indices of the tile's generated tokens in (f, h, w) raster order of the full grid."""
        _, gh, gw = (int(x) for x in grid)
        f = torch.arange(self.axes[0].start, self.axes[0].end, device=device)
        h = torch.arange(self.axes[1].start, self.axes[1].end, device=device)
        w = torch.arange(self.axes[2].start, self.axes[2].end, device=device)
        return (f[:, None, None] * (gh * gw) + h[None, :, None] * gw + w[None, None, :]).reshape(-1)

    def mask(self, device: torch.device | None = None) -> torch.Tensor:
        """Flat float32 blend weights of the tile's generated tokens (same order as `token_indices`)."""
        m = [trapezoid(a.size, a.left_ramp, a.right_ramp) for a in self.axes]
        return (m[0][:, None, None] * m[1][None, :, None] * m[2][None, None, :]).reshape(-1).to(device)


def build_tiles(grid: Sequence[int], tiling: Tiling) -> list[TdpTile]:
    """All tiles of a (frames, height, width) grid, in (f, h, w) product order."""
    per_axis = tiling.intervals(grid)
    return [TdpTile(i, axes) for i, axes in enumerate(itertools.product(*per_axis))]


def blend_weights(grid: Sequence[int], tiling: Tiling) -> torch.Tensor:
    """Sum of every tile's blend mask over the grid, shape (F, H, W): all ones for a valid tiling."""
    total = torch.zeros(int(grid[0]) * int(grid[1]) * int(grid[2]), dtype=torch.float32)
    for tile in build_tiles(grid, tiling):
        total.index_add_(0, tile.token_indices(grid), tile.mask())
    return total.reshape(*(int(g) for g in grid))


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

    # ---- geometry of the current stage -------------------------------------------------------------
    def set_latent_shape(self, shape: Any) -> None:
        """Declare the generated-token grid: a `VideoLatentShape` or (frames, height, width)."""
        if hasattr(shape, "frames"):
            self._grid = (int(shape.frames), int(shape.height), int(shape.width))
        else:
            f, h, w = (int(x) for x in shape)
            self._grid = (f, h, w)
        self.tiles_for(self._grid)  # validate now, on every rank alike

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
        tiles = self.tiles_for(grid)
        device = video.latent.device
        keep, counts = self._conditioning_plan(video.positions, grid, tiles, n_gen, total)

        b, _, c = video.latent.shape
        acc_v = torch.zeros((b, total, c), dtype=torch.float32, device=device)
        # Every rank owns >= 1 tile (checked above), so every rank produces an audio output iff audio is given:
        # the flat buffer has the same size everywhere.
        acc_a: torch.Tensor | None = None
        for tile in tiles[self.rank :: self.world_size]:
            gen_idx = tile.token_indices(grid, device)
            cond_idx = keep[tile.index].to(device) + n_gen
            idx = torch.cat([gen_idx, cond_idx])
            weights = torch.cat([tile.mask(device), 1.0 / counts[keep[tile.index]].to(device)])
            vx, ax = self.model(self._slice(video, idx, total, tile, grid), audio, perturbations)
            acc_v.index_add_(1, idx, vx.float() * weights[None, :, None])
            if ax is not None:
                acc_a = ax.float() if acc_a is None else acc_a + ax.float()
        flat = acc_v.reshape(-1) if acc_a is None else torch.cat([acc_v.reshape(-1), acc_a.reshape(-1)])
        flat = self._all_reduce(flat)
        vx_out = flat[: acc_v.numel()].view_as(acc_v).to(video.latent.dtype)
        ax_out = None
        if acc_a is not None:
            ax_out = (flat[acc_v.numel() :].view_as(acc_a) / len(tiles)).to(audio.latent.dtype)
        return vx_out, ax_out

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return flat
        staged = needs_host_staging(self.group, flat.device)
        buf = flat.cpu() if staged else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(flat.device) if staged else buf

    @staticmethod
    def _conditioning_plan(
        positions: torch.Tensor, grid: Sequence[int], tiles: list[TdpTile], n_gen: int, total: int
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Which conditioning tokens each tile keeps (indices relative to `n_gen`) and how many tiles keep
        each. Positions of batch row 0 decide (every row of a batch shares positions)."""
        n_cond = total - n_gen
        pos = positions[0].float().cpu()  # (3, T, 2): [start, end) per axis
        gen = pos[:, :n_gen].reshape(3, *(int(g) for g in grid), 2)
        cond = pos[:, n_gen:]  # (3, n_cond, 2)
        keep: dict[int, torch.Tensor] = {}
        counts = torch.zeros(n_cond, dtype=torch.float32)
        for tile in tiles:
            if n_cond == 0:
                keep[tile.index] = torch.zeros(0, dtype=torch.long)
                continue
            box = _tile_box(gen, tile)  # (3, 2)
            overlaps = ((cond[..., 0] < box[:, 1:2]) & (cond[..., 1] > box[:, 0:1])).all(dim=0)
            kept = overlaps | (cond[0, :, 0] < 0)
            keep[tile.index] = torch.nonzero(kept).reshape(-1)
            counts += kept.float()
        return keep, counts.clamp(min=1.0)

    def _slice(self, video: Any, idx: torch.Tensor, total: int, tile: TdpTile, grid: Sequence[int]) -> Any:
        changes: dict[str, Any] = {"latent": video.latent[:, idx]}
        positions = video.positions[:, :, idx]
        if self.normalize_positions:
            gen = video.positions[:, :, : grid[0] * grid[1] * grid[2]]
            gen = gen.reshape(gen.shape[0], gen.shape[1], *(int(g) for g in grid), gen.shape[-1])
            f, h, w = (slice(a.start, a.end) for a in tile.axes)
            origin = gen[:, :, f, h, w, 0].amin(dim=(2, 3, 4))  # (B, 3): the tile's start per axis
            positions = positions - origin[:, :, None, None].to(positions.dtype)
        changes["positions"] = positions
        for name in ("timesteps", "keyframes_mask", "segment_ids"):
            value = getattr(video, name, None)
            if _tokenwise(value, total):
                changes[name] = value[:, idx]
        mask = getattr(video, "attention_mask", None)
        if isinstance(mask, torch.Tensor):
            if mask.dim() == 3 and mask.shape[-1] == total and mask.shape[-2] == total:
                changes["attention_mask"] = mask[:, idx][:, :, idx]
            else:
                raise ValueError(f"TDP expects a (B, {total}, {total}) attention mask, got {tuple(mask.shape)}")
        return dataclasses.replace(video, **changes)


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
