"""Distributed video VAE decoding: spatial tiles of the final latent are decoded across ranks and blended on
the driver rank, which alone ends up with the frames (and writes the file).

Contract (every rank of `group` calls `decode` with the same latent, same order):
1. Every rank builds the same tile list: a height x width grid of latent tiles (`TileCountConfig` or
   `BalancedTiling` from `tdp.py`, frames untiled) with overlaps in latent units; in pixels a tile covers
   32x its latent box and its blend mask is the separable trapezoid of its pixel ramps.
2. Tile `i` is decoded by rank `i % world_size` (any tile count >= 1; ranks without tiles only wait).
   A tile may be decoded in chunks (`chunk_tiling`, ltx-core's single-device `TilingConfig`) to bound a
   rank's memory; chunks of one tile never cross ranks, so the two tilings cannot conflict.
3. Owners send each decoded tile to the driver point-to-point, in tile order; the driver accumulates
   tiles in tile order (the same floating-point order for every world size) into a float32 buffer and
   divides by the separable sum of the masks (exact for a product grid, no dense weight tensor).
4. Waits are bounded: every transfer is a collective of `group`, so a dead or wedged peer fails the
   transfer after the group's timeout (the reference blocks on `queue.get()` with no timeout).

Decoders with timestep conditioning inject noise; each tile draws it from its own generator seeded with
`seed + tile_index`, so the output does not depend on the world size. Only spatial inter-rank tiling is
supported (`frames` tiles > 1 raise `ValueError` up front): temporal splitting of a causal decoder belongs
to `chunk_tiling`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import needs_host_staging
from .tiling import AxisInterval, BalancedTiling, TileCountConfig, trapezoid

__all__ = ["DistributedDecoderBuilder", "DistributedVideoDecoder", "VaeTile", "frames_to_uint8", "vae_tiles"]

Tiling = TileCountConfig | BalancedTiling


@dataclass(frozen=True)
class VaeTile:
    """One spatial tile: its latent box (height, width intervals) and the scale to pixels."""

    index: int
    height: AxisInterval
    width: AxisInterval
    scale_h: int
    scale_w: int

    def latent_slice(self) -> tuple[slice, ...]:
        return (
            slice(None),
            slice(None),
            slice(None),
            slice(self.height.start, self.height.end),
            slice(self.width.start, self.width.end),
        )

    def pixel_slice(self) -> tuple[slice, slice]:
        return (
            slice(self.height.start * self.scale_h, self.height.end * self.scale_h),
            slice(self.width.start * self.scale_w, self.width.end * self.scale_w),
        )

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 1-D blend masks along pixel height and width."""
        h, w = self.height, self.width
        return (
            trapezoid(h.size * self.scale_h, h.left_ramp * self.scale_h, h.right_ramp * self.scale_h),
            trapezoid(w.size * self.scale_w, w.left_ramp * self.scale_w, w.right_ramp * self.scale_w),
        )


def vae_tiles(latent_shape: tuple[int, ...], tiling: Tiling, scale_h: int = 32, scale_w: int = 32) -> list[VaeTile]:
    """Tiles of a (B, C, F, H, W) latent; raises `ValueError` for temporal tiling or an impossible split."""
    _, _, frames, height, width = (int(x) for x in latent_shape)
    if isinstance(tiling, TileCountConfig) and tiling.frames.num_tiles != 1:
        raise ValueError("distributed VAE decoding tiles height and width only; use chunk_tiling for time")
    _, hs, ws = tiling.intervals((frames, height, width))
    return [VaeTile(i, h, w, scale_h, scale_w) for i, (h, w) in enumerate(itertools.product(hs, ws))]


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoder output (B, 3, F, H, W) in [-1, 1] -> uint8 frames (F, H, W, 3) of batch row 0."""
    frames = ((video[0].float() + 1.0) / 2.0).clamp(0.0, 1.0).mul(255.0).to(torch.uint8)
    return frames.permute(1, 2, 3, 0).contiguous()


class DistributedVideoDecoder:
    """Wraps an ltx-core `VideoDecoder`; see the module docstring.

    Args:
        decoder: the decoder module on this rank (every rank holds one; each decodes its own tiles).
        group: the VAE process group (None = default).
        tiling: inter-rank tile grid over the latent's height and width.
        driver_rank: group rank that receives and blends the tiles.
        chunk_tiling: optional ltx-core `TilingConfig` to decode each tile in chunks (memory bound).
        output_device: where the driver accumulates the frames (default: the decoder's device).
    """

    def __init__(
        self,
        decoder: torch.nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        tiling: Tiling,
        driver_rank: int = 0,
        chunk_tiling: Any = None,
        output_device: torch.device | str | None = None,
    ) -> None:
        if isinstance(tiling, TileCountConfig) and tiling.frames.num_tiles != 1:
            raise ValueError("distributed VAE decoding tiles height and width only; use chunk_tiling for time")
        self.decoder = decoder
        self.group = group
        self.tiling = tiling
        self.chunk_tiling = chunk_tiling
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if not 0 <= driver_rank < self.world_size:
            raise ValueError(f"driver_rank {driver_rank} is outside the group (size {self.world_size})")
        self.driver_rank = driver_rank
        self.output_device = None if output_device is None else torch.device(output_device)
        factors = getattr(decoder, "video_downscale_factors", None)
        self.scale_t, self.scale_h, self.scale_w = (
            (int(factors.time), int(factors.height), int(factors.width)) if factors is not None else (8, 32, 32)
        )

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    # ---- one tile -------------------------------------------------------------------------------------
    def _decode_tile(self, latent: torch.Tensor, tile: VaeTile, seed: int | None) -> torch.Tensor:
        part = latent[tile.latent_slice()].to(device=self.device, dtype=self.dtype)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(seed) + tile.index)
        with torch.no_grad():
            if self.chunk_tiling is None:
                return self.decoder(part, generator=gen)
            return torch.cat(list(self.decoder.tiled_decode(part, self.chunk_tiling, generator=gen)), dim=2)

    def _tile_shape(self, latent: torch.Tensor, tile: VaeTile) -> tuple[int, ...]:
        b, frames = int(latent.shape[0]), int(latent.shape[2])
        return (b, 3, (frames - 1) * self.scale_t + 1, tile.height.size * self.scale_h, tile.width.size * self.scale_w)

    # ---- the collective decode ------------------------------------------------------------------------
    def decode(self, latent: torch.Tensor, *, seed: int | None = None) -> torch.Tensor | None:
        """Collective. Returns the blended video (B, 3, F, H, W) float32 in [-1, 1] on the driver, None
        elsewhere. `latent` is the unpatchified (B, C, F', H', W') latent, identical on every rank."""
        tiles = vae_tiles(tuple(latent.shape), self.tiling, self.scale_h, self.scale_w)
        staged = self.world_size > 1 and needs_host_staging(self.group, self.device)
        if not self.is_driver:
            for tile in tiles:
                if tile.index % self.world_size == self.rank:
                    out = self._decode_tile(latent, tile, seed).contiguous()
                    expected = self._tile_shape(latent, tile)
                    if tuple(out.shape) != expected:  # a bug in this module, not an input error: fatal
                        raise RuntimeError(f"tile {tile.index} decoded to {tuple(out.shape)}, expected {expected}")
                    dist.send(out.cpu() if staged else out, dst=self._global(self.driver_rank), group=self.group)
            return None
        return self._gather_and_blend(latent, tiles, seed, staged)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _gather_and_blend(
        self, latent: torch.Tensor, tiles: list[VaeTile], seed: int | None, staged: bool
    ) -> torch.Tensor:
        b, _, frames, height, width = (int(x) for x in latent.shape)
        out_dev = self.output_device or self.device
        if len(tiles) == 1 and all(bool((m == 1).all()) for m in tiles[0].masks()):
            # One tile without ramps (a fleet of one): the blend below would be 0 + x * 1 / 1, the same bits
            # as x; skip the float32 accumulator of the whole video (570 MB at 768x512x121) and its passes.
            decoded = self._receive_or_decode(latent, tiles[0], seed, staged)
            return decoded.to(device=out_dev, dtype=torch.float32)
        n_frames = (frames - 1) * self.scale_t + 1
        acc = torch.zeros(
            (b, 3, n_frames, height * self.scale_h, width * self.scale_w), dtype=torch.float32, device=out_dev
        )
        wsum_h = torch.zeros(height * self.scale_h, dtype=torch.float32)
        wsum_w = torch.zeros(width * self.scale_w, dtype=torch.float32)
        seen_h: set[tuple[int, int]] = set()
        seen_w: set[tuple[int, int]] = set()
        for tile in tiles:
            decoded = self._receive_or_decode(latent, tile, seed, staged)
            mh, mw = tile.masks()
            ph, pw = tile.pixel_slice()
            weight = (mh[:, None] * mw[None, :]).to(out_dev)
            acc[:, :, :, ph, pw] += decoded.to(device=out_dev, dtype=torch.float32) * weight
            # The grid is a product of height and width intervals: the total weight is separable.
            if (tile.height.start, tile.height.end) not in seen_h:
                seen_h.add((tile.height.start, tile.height.end))
                wsum_h[ph] += mh
            if (tile.width.start, tile.width.end) not in seen_w:
                seen_w.add((tile.width.start, tile.width.end))
                wsum_w[pw] += mw
        norm = (wsum_h[:, None] * wsum_w[None, :]).clamp(min=1e-8).to(out_dev)
        return acc / norm

    def _receive_or_decode(self, latent: torch.Tensor, tile: VaeTile, seed: int | None, staged: bool) -> torch.Tensor:
        """Driver: the decoded `tile`, decoded here or received from its owner."""
        owner = tile.index % self.world_size
        if owner == self.rank:
            return self._decode_tile(latent, tile, seed)
        buf = torch.empty(self._tile_shape(latent, tile), dtype=self.dtype, device="cpu" if staged else self.device)
        dist.recv(buf, src=self._global(owner), group=self.group)
        return buf

    def decode_uint8(self, latent: torch.Tensor, *, seed: int | None = None) -> torch.Tensor | None:
        """Collective. uint8 frames (F, H, W, 3) on the driver (CPU), None elsewhere."""
        video = self.decode(latent, seed=seed)
        return None if video is None else frames_to_uint8(video).cpu()


class DistributedDecoderBuilder:
    """Builds a `DistributedVideoDecoder` from ltx-core's `SingleGPUModelBuilder` for the video decoder.

    Keeps the inner builder's checkpoint, sd ops and module ops; `build()` fails clearly when a tensor is
    still on the meta device after loading.
    """

    def __init__(
        self,
        inner: Any,
        *,
        group: dist.ProcessGroup | None = None,
        tiling: Tiling,
        driver_rank: int = 0,
        chunk_tiling: Any = None,
        registry: Any = None,
    ) -> None:
        from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

        if not isinstance(inner, SingleGPUModelBuilder):
            raise TypeError(f"DistributedDecoderBuilder wraps a SingleGPUModelBuilder, got {type(inner).__name__}")
        if isinstance(tiling, TileCountConfig) and tiling.frames.num_tiles != 1:
            raise ValueError("distributed VAE decoding tiles height and width only; use chunk_tiling for time")
        if registry is not None:
            inner = dataclasses.replace(inner, registry=registry)
        self.inner = inner
        self.group = group
        self.tiling = tiling
        self.driver_rank = driver_rank
        self.chunk_tiling = chunk_tiling

    def build(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DistributedVideoDecoder:
        decoder = self.inner.build(device=torch.device(device), dtype=dtype)
        meta = [n for n, p in decoder.named_parameters() if p.is_meta]
        meta += [n for n, b in decoder.named_buffers() if b.is_meta]
        if meta:
            raise RuntimeError(
                f"video decoder {self.inner.model_path!r}: {len(meta)} tensors are still on the meta device after "
                f"loading (first: {meta[:3]}); the checkpoint lacks them"
            )
        return DistributedVideoDecoder(
            decoder.eval().requires_grad_(False),
            group=self.group,
            tiling=self.tiling,
            driver_rank=self.driver_rank,
            chunk_tiling=self.chunk_tiling,
        )
