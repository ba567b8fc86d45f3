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
   divides by the separable sum of the masks (exact for a product grid, no dense weight tensor). With
   `chunk_tiling` this runs per temporal chunk (`decode_chunks`): owners send chunk by chunk, the driver
   blends each chunk as its tiles arrive and yields its final frames while later chunks still decode
   (the streamed hand-off, `runners.common.handoff`), bit for bit the frames of the whole-video blend.
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..sharding.collectives import needs_host_staging
from .tiling import AxisInterval, BalancedTiling, TileCountConfig, trapezoid

__all__ = ["DistributedDecoderBuilder", "DistributedVideoDecoder", "VaeTile", "frames_to_uint8", "vae_tiles"]

Tiling = TileCountConfig | BalancedTiling
_END = -1  #: the chunk header after a tile's last chunk


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


#: float32 bytes of one frame-chunk's temporaries in `frames_to_uint8`
FRAME_CHUNK_BYTES = 256 << 20


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoder output (B, 3, F, H, W) in [-1, 1] -> uint8 frames (F, H, W, 3) of batch row 0.

    A few frames at a time, into the output: converting the whole clip at once held two float32 copies of it
    beside the decoder's output (36 bytes a pixel-frame at the driver against the memory plan's 15), which ran
    1920x1088x241 out of memory on an 80 GB card. The arithmetic per element is the one-piece expression's, so
    the bytes are the same."""
    clip = video[0]
    channels, frames, height, width = clip.shape
    out = torch.empty((frames, height, width, channels), dtype=torch.uint8, device=clip.device)
    step = max(1, FRAME_CHUNK_BYTES // max(1, channels * height * width * 4))
    for start in range(0, frames, step):
        part = ((clip[:, start : start + step].float() + 1.0) / 2.0).clamp(0.0, 1.0).mul(255.0).to(torch.uint8)
        out[start : start + step] = part.permute(1, 2, 3, 0)
    return out


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
    def _tile_chunks(self, latent: torch.Tensor, tile: VaeTile, seed: int | None) -> Iterator[torch.Tensor]:
        """The decoded `tile` in temporal chunks of final frames (one chunk without `chunk_tiling`). Lazy:
        each `next` decodes; the caller holds `torch.no_grad()` around it (a generator cannot scope it)."""
        part = latent[tile.latent_slice()].to(device=self.device, dtype=self.dtype)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(seed) + tile.index)
        if self.chunk_tiling is None:
            yield self.decoder(part, generator=gen)
            return
        # ltx-core yields a temporal chunk only once the next one is blended into its overlap: final frames
        yield from self.decoder.tiled_decode(part, self.chunk_tiling, generator=gen)

    def _tile_shape(self, latent: torch.Tensor, tile: VaeTile, frames: int | None = None) -> tuple[int, ...]:
        b = int(latent.shape[0])
        n = self.output_shape(tuple(latent.shape))[0] if frames is None else int(frames)
        return (b, 3, n, tile.height.size * self.scale_h, tile.width.size * self.scale_w)

    def output_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(frames, height, width) in pixels of the decode of a (B, C, F', H', W') latent."""
        _, _, frames, height, width = (int(x) for x in latent_shape)
        return (frames - 1) * self.scale_t + 1, height * self.scale_h, width * self.scale_w

    # ---- the collective decode ------------------------------------------------------------------------
    def decode(self, latent: torch.Tensor, *, seed: int | None = None) -> torch.Tensor | None:
        """Collective. Returns the blended video (B, 3, F, H, W) float32 in [-1, 1] on the driver, None
        elsewhere. `latent` is the unpatchified (B, C, F', H', W') latent, identical on every rank."""
        out: torch.Tensor | None = None
        at = 0
        for chunk in self.decode_chunks(latent, seed=seed):
            if chunk is None:
                continue
            if at == 0 and int(chunk.shape[2]) == self.output_shape(tuple(latent.shape))[0]:
                out = chunk  # (one chunk: no copy)
            else:
                if out is None:
                    f, h, w = self.output_shape(tuple(latent.shape))
                    out = torch.empty((int(chunk.shape[0]), 3, f, h, w), dtype=torch.float32, device=chunk.device)
                out[:, :, at : at + int(chunk.shape[2])] = chunk
            at += int(chunk.shape[2])
        return out

    def decode_chunks(self, latent: torch.Tensor, *, seed: int | None = None) -> Iterator[torch.Tensor | None]:
        """Collective generator: every rank of the group iterates it to its end. Yields, per temporal chunk
        of `chunk_tiling` (one chunk without it), the blended frames (B, 3, f, H, W) float32 on the driver
        (final: later chunks never change them; concatenated, exactly `decode`'s video), None elsewhere.

        Order on the wire: chunk by chunk, tiles in tile order within a chunk, each part after a one-number
        header (its frame count; -1 after a tile's last chunk), so the driver blends a chunk as soon as its
        tiles are in and needs no knowledge of ltx-core's temporal split."""
        tiles = vae_tiles(tuple(latent.shape), self.tiling, self.scale_h, self.scale_w)
        staged = self.world_size > 1 and needs_host_staging(self.group, self.device)
        mine = {t.index: self._tile_chunks(latent, t, seed) for t in tiles if t.index % self.world_size == self.rank}
        if not self.is_driver:
            yield from self._send_chunks(latent, tiles, mine, staged)
            return
        yield from self._blend_chunks(latent, tiles, mine, staged)

    def _header(self, staged: bool, value: int = 0) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64, device="cpu" if staged or self.world_size == 1 else self.device)

    def _send_chunks(
        self, latent: torch.Tensor, tiles: list[VaeTile], mine: dict[int, Iterator[torch.Tensor]], staged: bool
    ) -> Iterator[None]:
        owned = [t for t in tiles if t.index in mine]
        driver = self._global(self.driver_rank)
        while owned:
            ended = 0
            for tile in owned:
                with torch.no_grad():
                    out = next(mine[tile.index], None)
                if out is None:
                    dist.send(self._header(staged, _END), dst=driver, group=self.group)
                    ended += 1
                    continue
                out = out.contiguous()
                expected = self._tile_shape(latent, tile, int(out.shape[2]))
                if tuple(out.shape) != expected:  # a bug in this module, not an input error: fatal
                    raise RuntimeError(f"tile {tile.index} decoded to {tuple(out.shape)}, expected {expected}")
                dist.send(self._header(staged, int(out.shape[2])), dst=driver, group=self.group)
                if int(out.shape[2]):  # (ltx-core may yield an empty first chunk: a header alone)
                    dist.send(out.cpu() if staged else out, dst=driver, group=self.group)
            if ended:
                if ended != len(owned):
                    raise RuntimeError("tiles of one decode ended after different numbers of temporal chunks")
                return
            yield None

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _blend_chunks(
        self, latent: torch.Tensor, tiles: list[VaeTile], mine: dict[int, Iterator[torch.Tensor]], staged: bool
    ) -> Iterator[torch.Tensor]:
        """Driver: chunk by chunk, every tile's part blended in tile order (the same floating-point order for
        every world size and chunking: each pixel sees the same sums as a whole-video blend)."""
        out_dev = self.output_device or self.device
        b, (n_frames, height, width) = int(latent.shape[0]), self.output_shape(tuple(latent.shape))
        # One tile without ramps (a fleet of one): the blend would be 0 + x * 1 / 1, the same bits as x; skip
        # the float32 accumulator (570 MB at 768x512x121) and its passes.
        plain = len(tiles) == 1 and all(bool((m == 1).all()) for m in tiles[0].masks())
        weights: list[torch.Tensor] = []
        wsum_h = torch.zeros(height, dtype=torch.float32)
        wsum_w = torch.zeros(width, dtype=torch.float32)
        seen_h: set[tuple[int, int]] = set()
        seen_w: set[tuple[int, int]] = set()
        for tile in tiles:
            mh, mw = tile.masks()
            ph, pw = tile.pixel_slice()
            weights.append((mh[:, None] * mw[None, :]).to(out_dev))
            # The grid is a product of height and width intervals: the total weight is separable.
            if (tile.height.start, tile.height.end) not in seen_h:
                seen_h.add((tile.height.start, tile.height.end))
                wsum_h[ph] += mh
            if (tile.width.start, tile.width.end) not in seen_w:
                seen_w.add((tile.width.start, tile.width.end))
                wsum_w[pw] += mw
        norm = (wsum_h[:, None] * wsum_w[None, :]).clamp(min=1e-8).to(out_dev)
        done = 0
        while True:
            acc: torch.Tensor | None = None
            ended = 0
            for tile, weight in zip(tiles, weights, strict=True):
                decoded = self._next_part(latent, tile, mine, staged)
                if decoded is None:
                    ended += 1
                    continue
                if plain:
                    acc = decoded.to(device=out_dev, dtype=torch.float32)
                    continue
                if acc is None:
                    acc = torch.zeros((b, 3, int(decoded.shape[2]), height, width), dtype=torch.float32, device=out_dev)
                ph, pw = tile.pixel_slice()
                acc[:, :, :, ph, pw] += decoded.to(device=out_dev, dtype=torch.float32) * weight
            if ended:
                if ended != len(tiles) or done != n_frames:
                    raise RuntimeError(
                        f"decode chunks ended unevenly ({ended} of {len(tiles)} tiles, {done} of {n_frames} frames)"
                    )
                return
            assert acc is not None
            done += int(acc.shape[2])
            if int(acc.shape[2]):  # (ltx-core's first chunk may be empty)
                yield acc if plain else acc / norm

    def _next_part(
        self, latent: torch.Tensor, tile: VaeTile, mine: dict[int, Iterator[torch.Tensor]], staged: bool
    ) -> torch.Tensor | None:
        """Driver: the next chunk of `tile`, decoded here or received from its owner; None after its last."""
        if tile.index in mine:
            with torch.no_grad():
                return next(mine[tile.index], None)
        owner = self._global(tile.index % self.world_size)
        header = self._header(staged)
        dist.recv(header, src=owner, group=self.group)
        if int(header.item()) == _END:
            return None
        buf = torch.empty(
            self._tile_shape(latent, tile, int(header.item())),
            dtype=self.dtype,
            device="cpu" if staged else self.device,
        )
        if buf.numel():
            dist.recv(buf, src=owner, group=self.group)
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
