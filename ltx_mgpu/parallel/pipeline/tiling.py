"""Tiling geometry for tiled data parallelism (`tdp.py`) and the distributed VAE decoder (`vae_decode.py`):
per-axis intervals with overlaps, tile grids (fixed counts or balanced per geometry), and the separable
trapezoidal masks that blend overlapping tiles so that, at every token, the masks of all tiles sum to one.

Pure functions and small frozen dataclasses: no process group, no model. A tiling the grid cannot hold (more
tiles than an axis has positions, overlaps where three tiles would meet) is a `ValueError` raised the same
way on every rank, since every rank computes the same geometry.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AxisInterval",
    "BalancedTiling",
    "DimensionTiling",
    "TdpTile",
    "TileCountConfig",
    "Tiling",
    "blend_weights",
    "build_tiles",
    "split_axis",
    "trapezoid",
]

_AXES = ("frames", "height", "width")


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
