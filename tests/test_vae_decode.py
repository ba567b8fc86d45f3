"""Distributed video VAE decoding on CPU ranks: the blended result on the driver equals the single-process
decode of the same tiles (tolerance 1e-5, float32; in practice bit-identical because the driver blends in
tile order on every world size), one tile equals ltx-core's plain decode exactly, and a token-local
decoder is reproduced exactly by the blend (partition of unity in pixel space).

Tiled-vs-untiled closeness of a *real* decoder depends on its receptive field and weights (random tiny
weights are far from smooth), so it is not asserted here; the blend geometry is checked with the
token-local decoder instead.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.parallel.pipeline.tiling import BalancedTiling, DimensionTiling, TileCountConfig
from ltx_mgpu.parallel.pipeline.vae_decode import DistributedVideoDecoder, frames_to_uint8, vae_tiles
from ltx_mgpu.parallel.testing import LocalWorld

LATENT_SHAPE = (1, 16, 2, 4, 6)
GRID_2x2 = TileCountConfig(height=DimensionTiling(2, 1), width=DimensionTiling(2, 1))


def tiny_decoder(*, timestep_conditioning: bool = False, seed: int = 0) -> torch.nn.Module:
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator

    from ltx_mgpu.runners.smoke.checkpoint import tiny_video_decoder_config

    cfg = tiny_video_decoder_config(latent_channels=16)
    cfg["vae"]["timestep_conditioning"] = timestep_conditioning
    if timestep_conditioning:  # the noise-injecting variant (older LTX VAEs)
        cfg["vae"]["decoder_blocks"] = [
            [name, {**params, "inject_noise": True} if name == "res_x" else params]
            for name, params in cfg["vae"]["decoder_blocks"]
        ]
    decoder = VideoDecoderConfigurator.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(decoder.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * (p[0].numel() ** -0.5 if p.dim() >= 2 else 0.1))
        for name, b in decoder.named_buffers():
            b.fill_(1.0 if "std" in name else 0.0)
    return decoder.eval().requires_grad_(False)


def latent(seed: int = 7) -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(seed))


class NearestDecoder(torch.nn.Module):
    """Token-local 'decoder': each latent cell becomes a 32x32 block (8 frames per latent frame)."""

    video_downscale_factors = type("F", (), {"time": 8, "height": 32, "width": 32})()

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(3, 16, generator=torch.Generator().manual_seed(3)) * 0.2)

    def forward(self, x, generator=None):
        del generator
        rgb = torch.einsum("oc,bcfhw->bofhw", self.proj, x).tanh()
        rgb = torch.cat([rgb[:, :, :1], rgb[:, :, 1:].repeat_interleave(8, dim=2)], dim=2)
        return rgb.repeat_interleave(32, dim=3).repeat_interleave(32, dim=4)


# ---- one process -------------------------------------------------------------------------------------------
@pytest.mark.numerics
def test_one_tile_is_the_plain_decode():
    dec = tiny_decoder()
    x = latent()
    with torch.no_grad():
        ref = dec(x)
    out = DistributedVideoDecoder(dec, tiling=TileCountConfig()).decode(x)
    assert out.shape == (1, 3, 9, 128, 192)
    # bit for bit: one tile is the same decoder on the same tensor in the same process and thread pool, so
    # the same kernels sum in the same order on any CPU
    assert torch.equal(out, ref.float())


def test_one_tile_makes_no_float32_accumulator(monkeypatch):
    """A fleet of one decodes one tile without ramps: its blend is x * 1 / 1, so the decoder's output is taken
    as it is (same bits, pinned above) and no float32 buffer of the whole video is allocated and summed."""
    from ltx_mgpu.parallel.pipeline import vae_decode

    shapes = []
    real_zeros = torch.zeros

    def zeros(*size, **kwargs):
        shapes.append(tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple) else size)
        return real_zeros(*size, **kwargs)

    monkeypatch.setattr(vae_decode.torch, "zeros", zeros)
    DistributedVideoDecoder(NearestDecoder(), tiling=TileCountConfig()).decode(latent())
    assert not [s for s in shapes if len(s) == 5], shapes
    DistributedVideoDecoder(NearestDecoder(), tiling=GRID_2x2).decode(latent())  # tiles do blend
    assert [s for s in shapes if len(s) == 5] == [(1, 3, 9, 128, 192)]


@pytest.mark.numerics
@pytest.mark.parametrize("tiling", [GRID_2x2, TileCountConfig(width=DimensionTiling(3, 1)), BalancedTiling(4, 1)])
def test_token_local_decoder_is_reproduced_exactly(tiling):
    dec = NearestDecoder()
    x = latent()
    with torch.no_grad():
        ref = dec(x)
    out = DistributedVideoDecoder(dec, tiling=tiling).decode(x)
    # a token-local decoder gives each tile the untiled values: only the blend weights (summing to 1 within
    # a few u = 6e-8) round differently, on outputs of magnitude ~1
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_temporal_inter_rank_tiling_is_refused():
    with pytest.raises(ValueError, match="height and width only"):
        DistributedVideoDecoder(NearestDecoder(), tiling=TileCountConfig(frames=DimensionTiling(2)))


def test_uint8_conversion_matches_ltx_core():
    from ltx_core.model.video_vae.video_vae import decode_video

    dec = tiny_decoder()
    x = latent()
    with torch.no_grad():
        ref = torch.cat(list(decode_video(x, dec)), dim=0)
    out = DistributedVideoDecoder(dec, tiling=TileCountConfig()).decode_uint8(x)
    assert out.dtype == torch.uint8 and out.shape == ref.shape
    assert (out.int() - ref.int()).abs().max().item() <= 1  # float32 rounding at .5 boundaries
    assert frames_to_uint8(torch.zeros(1, 3, 1, 2, 2)).unique().tolist() == [127]


def test_tiles_cover_the_latent():
    tiles = vae_tiles(LATENT_SHAPE, GRID_2x2)
    assert len(tiles) == 4
    assert {(t.height.start, t.height.end) for t in tiles} == {(0, 3), (2, 4)}
    assert {(t.width.start, t.width.end) for t in tiles} == {(0, 4), (3, 6)}


# ---- two CPU ranks -----------------------------------------------------------------------------------------
def _rank_decode(ctx, tiling, timestep_conditioning, seed):
    import torch.distributed as dist

    dec = tiny_decoder(timestep_conditioning=timestep_conditioning)
    out = DistributedVideoDecoder(dec, group=dist.group.WORLD, tiling=tiling).decode(latent(), seed=seed)
    return None if out is None else out


@pytest.fixture(scope="module")
def world():
    with LocalWorld(2) as w:
        yield w


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("tiling", "timestep_conditioning", "seed"),
    [
        (GRID_2x2, False, None),
        (TileCountConfig(width=DimensionTiling(3, 1)), True, 11),
        (TileCountConfig(), False, None),
    ],
)
def test_two_ranks_equal_single_process(world, tiling, timestep_conditioning, seed):
    single = DistributedVideoDecoder(tiny_decoder(timestep_conditioning=timestep_conditioning), tiling=tiling).decode(
        latent(), seed=seed
    )
    driver, other = world.run(_rank_decode, tiling, timestep_conditioning, seed)
    assert other is None  # only the driver holds frames
    # the same tiles convolved over fewer columns per call (oneDNN/MKL block the fp32 sums differently) and
    # blended: ~1e-6 at the tiny decoder's channel counts on outputs of magnitude ~1; 1e-5 with room
    torch.testing.assert_close(driver, single, rtol=0, atol=1e-5)


# ---- temporal chunks (the streamed hand-off) ---------------------------------------------------------------
LONG_LATENT = (1, 16, 6, 4, 6)  # 41 frames: three temporal tiles of 2 latent frames, overlap 1


def _chunking():
    from ltx_core.model.video_vae import TemporalTilingConfig, TilingConfig

    return TilingConfig(temporal_config=TemporalTilingConfig(tile_size_in_frames=16, tile_overlap_in_frames=8))


def long_latent(seed: int = 5) -> torch.Tensor:
    return torch.randn(LONG_LATENT, generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
def test_temporal_chunks_are_ltx_cores_final_frames_and_come_before_the_last_tile_decodes():
    """One tile with `chunk_tiling`: each yielded chunk is ltx-core's `tiled_decode` chunk bit for bit (its
    frames are final: ltx-core yields a chunk only after the next one is blended in), and the first arrives
    while temporal tiles are still to decode (a streamed hand-off can start encoding it)."""
    dec, x = tiny_decoder(), long_latent()
    with torch.no_grad():
        ref = [c for c in dec.tiled_decode(x, _chunking()) if c.shape[2]]  # (its first chunk may be empty)
    calls: list[int] = []
    real_forward = dec.forward
    dec.forward = lambda *a, **k: calls.append(1) or real_forward(*a, **k)  # (tiled_decode calls self.forward)
    chunks, calls_at_first = [], None
    for chunk in DistributedVideoDecoder(dec, tiling=TileCountConfig(), chunk_tiling=_chunking()).decode_chunks(x):
        calls_at_first = len(calls) if calls_at_first is None else calls_at_first
        chunks.append(chunk)
    assert len(chunks) == len(ref) > 2
    assert all(torch.equal(a, b.float()) for a, b in zip(chunks, ref, strict=True))
    assert sum(int(c.shape[2]) for c in chunks) == 41
    assert calls_at_first is not None and calls_at_first < len(calls)  # the rest decoded after the first chunk


def _rank_chunks(ctx, tiling, seed):
    import torch.distributed as dist

    dec = DistributedVideoDecoder(tiny_decoder(timestep_conditioning=True), group=dist.group.WORLD, tiling=tiling,
                                  chunk_tiling=_chunking())  # fmt: skip
    return [c for c in dec.decode_chunks(long_latent(), seed=seed)]


@pytest.mark.numerics
def test_two_ranks_stream_the_same_chunks_as_one_process(world):
    """Tiles on two ranks, each decoded in temporal chunks: the driver yields the same chunks (frame counts
    and values) as one process, the other rank only Nones; `decode` is their concatenation."""
    single_dec = DistributedVideoDecoder(tiny_decoder(timestep_conditioning=True), tiling=GRID_2x2,
                                         chunk_tiling=_chunking())  # fmt: skip
    single = list(single_dec.decode_chunks(long_latent(), seed=3))
    driver, other = world.run(_rank_chunks, GRID_2x2, 3)
    assert len(single) > 2 and other and all(x is None for x in other)
    assert [int(c.shape[2]) for c in driver] == [int(c.shape[2]) for c in single]
    for a, b in zip(driver, single, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert torch.equal(torch.cat(single, dim=2), single_dec.decode(long_latent(), seed=3))


def test_uint8_conversion_in_frame_chunks_is_the_one_piece_conversion_byte_for_byte(monkeypatch):
    """`frames_to_uint8` converts a few frames at a time (bounded temporaries); forced to one frame a chunk, and
    with a chunk that does not divide the clip, every byte equals the whole-clip expression's."""
    from ltx_mgpu.parallel.pipeline import vae_decode

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        video = (torch.rand(2, 3, 7, 5, 6, generator=g) * 2.4 - 1.2).to(dtype)  # past [-1, 1]: the clamp
        whole = ((video[0].float() + 1.0) / 2.0).clamp(0.0, 1.0).mul(255.0).to(torch.uint8).permute(1, 2, 3, 0)
        for chunk_bytes in (1, 3 * 5 * 6 * 4 * 3):  # one frame, three frames (7 = 3 + 3 + 1)
            monkeypatch.setattr(vae_decode, "FRAME_CHUNK_BYTES", chunk_bytes)
            out = frames_to_uint8(video)
            assert out.is_contiguous() and out.shape == (7, 5, 6, 3) and torch.equal(out, whole)
