"""Sequence partitioning, the token budget, the backend registry and the custom ops' fake shapes: the SP
pieces that need no process group."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ltx_core.model.transformer.modality import Modality

from ltx_mgpu.parallel import (
    SequenceParallelBuilder,
    check_token_budget,
    compute_sequence_offsets,
    compute_sequence_partition,
    get_backend_factory,
    pad_modality_for_uniform_sharding,
    padded_token_count,
    register_backend,
    tile_modality_for_rank,
)


def _modality(t: int, *, batch: int = 1, mask: torch.Tensor | None = None, channels: int = 4) -> Modality:
    g = torch.Generator().manual_seed(t)
    return Modality(
        latent=torch.randn(batch, t, channels, generator=g),
        sigma=torch.full((batch,), 0.5),
        timesteps=torch.rand(batch, t, 1, generator=g) + 0.1,
        positions=torch.rand(batch, 3, t, 2, generator=g) + 0.1,
        context=torch.randn(batch, 3, 8, generator=g),
        context_mask=torch.ones(batch, 3, dtype=torch.int64),
        attention_mask=mask,
    )


def test_partition_and_offsets() -> None:
    assert compute_sequence_partition(12, 4) == [3, 3, 3, 3]
    assert compute_sequence_offsets([3, 3, 3, 3]) == [0, 3, 6, 9]
    assert compute_sequence_offsets([2, 5, 1]) == [0, 2, 7]
    assert padded_token_count(10, 4) == 12
    assert padded_token_count(12, 4) == 12
    with pytest.raises(
        ValueError,
        match=r"compute_sequence_partition expects uniform sharding: total_tokens \(10\) must be divisible by "
        r"world_size \(4\)\. Pad the modality up-front\.",
    ):
        compute_sequence_partition(10, 4)


def test_divisible_modality_is_unchanged() -> None:
    m = _modality(8)
    padded, n = pad_modality_for_uniform_sharding(m, 4)
    assert padded is m and n == 8


def test_padding_without_user_mask_builds_key_only_mask() -> None:
    m = _modality(7, batch=2)
    padded, n = pad_modality_for_uniform_sharding(m, 4)
    assert n == 7
    assert padded.latent.shape == (2, 8, 4)
    assert padded.timesteps.shape == (2, 8, 1)
    assert padded.positions.shape == (2, 3, 8, 2)
    assert torch.equal(padded.latent[:, :7], m.latent) and not padded.latent[:, 7:].any()
    assert torch.equal(padded.timesteps[:, :7], m.timesteps) and not padded.timesteps[:, 7:].any()
    assert torch.equal(padded.positions[:, :, :7], m.positions) and not padded.positions[:, :, 7:].any()
    # O(T) key-only mask broadcast over batch and queries, not a dense (B, T, T) matrix.
    assert padded.attention_mask.shape == (1, 1, 8)
    assert padded.attention_mask.dtype == torch.float32
    assert padded.attention_mask.flatten().tolist() == [1.0] * 7 + [0.0]
    # context and sigma are not per-token: untouched
    assert padded.context is m.context and padded.sigma is m.sigma


def test_padding_extends_user_mask() -> None:
    user = (torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    padded, n = pad_modality_for_uniform_sharding(_modality(5, batch=2, mask=user), 3)
    mask = padded.attention_mask
    assert n == 5 and mask.shape == (2, 6, 6)
    assert torch.equal(mask[:, :5, :5], user)
    assert torch.all(mask[:, 5:, :5] == 1)  # padded query rows attend to every real key
    assert not mask[:, :, 5:].any()  # padded keys are masked for every query


def test_padding_rejects_misshaped_user_mask() -> None:
    with pytest.raises(ValueError, match="attention mask"):
        pad_modality_for_uniform_sharding(_modality(5, mask=torch.ones(1, 5, 4)), 2)


def test_tiles_reassemble_the_padded_modality() -> None:
    padded, _ = pad_modality_for_uniform_sharding(_modality(10, batch=2), 4)
    tiles = []
    for rank in range(4):
        tile, counts = tile_modality_for_rank(padded, rank, 4)
        assert counts == [3, 3, 3, 3]
        assert tile.latent.shape == (2, 3, 4)
        assert tile.attention_mask is padded.attention_mask  # full-size: every rank attends over all keys
        tiles.append(tile)
    assert torch.equal(torch.cat([t.latent for t in tiles], 1), padded.latent)
    assert torch.equal(torch.cat([t.timesteps for t in tiles], 1), padded.timesteps)
    assert torch.equal(torch.cat([t.positions for t in tiles], 2), padded.positions)
    with pytest.raises(ValueError, match="uniform sharding"):
        tile_modality_for_rank(_modality(10), 0, 4)  # not padded first


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 40), w=st.integers(1, 8))
def test_pad_then_tile_roundtrip_property(t: int, w: int) -> None:
    padded, n = pad_modality_for_uniform_sharding(_modality(t), w)
    assert n == t and padded.latent.shape[1] % w == 0 and padded.latent.shape[1] - t < w
    parts = [tile_modality_for_rank(padded, r, w)[0].latent for r in range(w)]
    assert len({p.shape[1] for p in parts}) == 1
    assert torch.equal(torch.cat(parts, 1)[:, :t], _modality(t).latent)


def test_token_budget_message() -> None:
    check_token_budget(4096, 1, 4096)
    with pytest.raises(ValueError, match=r"\(4100\) exceeds attention_manager max_tokens \(4096\)") as err:
        check_token_budget(4100, 1, 4096)
    assert str(err.value).endswith("Use a smaller resolution or fewer frames.")
    # The batch counts (the exchange buffers hold batch x tokens rows).
    with pytest.raises(ValueError, match=r"3000 x batch 2 = 6000") as err:
        check_token_budget(3000, 2, 4096)
    assert str(err.value).endswith("Use a smaller resolution or fewer frames.")


def test_builder_rejects_other_builders() -> None:
    with pytest.raises(TypeError, match="SequenceParallelBuilder wraps a SingleGPUModelBuilder, got object"):
        SequenceParallelBuilder(object(), None)  # type: ignore[arg-type]


def test_backend_registry() -> None:
    assert get_backend_factory("dist").__name__ == "create_dist_backend"
    with pytest.raises(ValueError, match="Unknown all2all backend 'nope'"):
        get_backend_factory("nope")
    with pytest.raises(ValueError):
        register_backend("", lambda **_: None)  # type: ignore[arg-type,return-value]


def test_ipc_is_not_picked_without_cuda() -> None:
    from ltx_mgpu.parallel.sp.all2all import ipc_is_available

    assert ipc_is_available(torch.device("cpu")) is False


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_custom_op_fake_shapes(world: int) -> None:
    """The fakes derive shapes from the input alone (uniform sharding), so tracing needs no runtime."""
    x = torch.empty(2, 5, 8 * world, 16, device="meta")
    y = torch.ops.ltx_mgpu.send_recv_heads(x, 12345, world)
    assert y.shape == (2, 5 * world, 8, 16)
    z = torch.ops.ltx_mgpu.gather_heads(y, 12345, world)
    assert z.shape == x.shape
    a = torch.ops.ltx_mgpu.all_gather_heads(torch.empty(2, 7, 8, 16, device="meta"), 12345, world)
    assert a.shape == (2, 7, 8 * world, 16)
    assert y.dtype == x.dtype


def test_custom_op_without_runtime_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="all2all runtime 987654 is not registered"):
        torch.ops.ltx_mgpu.send_recv_heads(torch.zeros(1, 2, 4, 2), 987654, 2)


def test_single_process_without_a_process_group(tmp_path: Path) -> None:
    """No torch.distributed at all: SP degenerates to world size 1 and equals the plain model; the token
    budget still applies."""
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    from ltx_mgpu.parallel import AttentionManager
    from ltx_mgpu.runners.smoke import ensure_smoke_checkpoint

    ck = ensure_smoke_checkpoint(tmp_path)
    inner = SingleGPUModelBuilder(LTXModelConfigurator, str(ck.transformer_path))
    cfg = ck.transformer_config["transformer"]
    mgr = AttentionManager(8, cfg["num_attention_heads"], cfg["attention_head_dim"], torch.float32)
    assert (mgr.rank, mgr.world_size, mgr.channels) == (0, 1, {})
    sp = SequenceParallelBuilder(inner, mgr).build(device=torch.device("cpu"))
    plain = inner.build(device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    video = _modality(6, channels=cfg["in_channels"])
    video = dataclasses.replace(video, context=torch.randn(1, 3, cfg["caption_channels"], generator=g))
    pert = BatchedPerturbationConfig.empty(1)
    with torch.no_grad():
        assert torch.equal(sp(video, None, pert)[0], plain(video, None, pert)[0])
    too_long = dataclasses.replace(video, latent=torch.zeros(1, 9, cfg["in_channels"]))
    with pytest.raises(ValueError, match="Use a smaller resolution or fewer frames."):
        sp(too_long, None, pert)
