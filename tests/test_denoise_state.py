"""`denoise.make_state` and `denoise.modality`: which jobs give the transformer one timestep per row.

A state's mask becomes a stride-0 view along the tokens only where every token's value is the same (checked,
not assumed), and `modality()` turns such a mask into (B, 1, 1) timesteps of the same values; any other mask
gives per-token timesteps, exactly as before."""

from __future__ import annotations

import dataclasses

import torch

from ltx_mgpu.runners.ltx2.denoise import make_state, modality, one_for_every_token
from ltx_mgpu.runners.smoke.denoise import SmokeGeometry


def _tools():
    return SmokeGeometry(64, 64, 17, 24.0, 8, 8).video_tools(1)


class _MaskedTools:
    """ltx-core's tools with an initial mask of another making (not all ones)."""

    def __init__(self, tools, mask_fn):
        self.tools, self.mask_fn = tools, mask_fn

    def create_initial_state(self, device, dtype, latent=None):
        state = self.tools.create_initial_state(device, dtype, latent)
        return dataclasses.replace(state, denoise_mask=self.mask_fn(state.denoise_mask))


def _state(tools, **kw):
    return make_state(tools, [], generator=torch.Generator().manual_seed(0), noise_scale=1.0,
                      device=torch.device("cpu"), dtype=torch.float32, **kw)  # fmt: skip


def test_a_uniform_mask_becomes_one_timestep_per_row_with_the_same_values() -> None:
    state = _state(_tools())
    mask = state.denoise_mask
    assert mask.shape[1] > 1 and mask.stride(1) == 0 and torch.equal(mask, torch.ones_like(mask))
    sigma = torch.tensor(0.625)
    ctx = torch.zeros(1, 4, 8)
    one = modality(state, ctx, sigma, batch=2)
    assert one.timesteps.shape == (2, 1, 1) and torch.equal(one.timesteps, torch.full((2, 1, 1), 0.625))
    per_token = modality(dataclasses.replace(state, denoise_mask=mask.contiguous()), ctx, sigma, batch=2)
    assert per_token.timesteps.shape == (2, mask.shape[1], 1)  # a copied mask is an ordinary per-token one
    assert torch.equal(per_token.timesteps, one.timesteps.expand_as(per_token.timesteps))
    frozen = _state(_tools(), frozen=True)
    assert frozen.denoise_mask.stride(1) == 0 and modality(frozen, ctx, sigma).timesteps.abs().sum() == 0


def test_a_mask_that_is_not_uniform_stays_per_token() -> None:
    def half(mask: torch.Tensor) -> torch.Tensor:
        out = mask.clone()
        out[:, : out.shape[1] // 2] = 0.25
        return out

    state = _state(_MaskedTools(_tools(), half))
    assert state.denoise_mask.stride(1) != 0
    steps = modality(state, torch.zeros(1, 4, 8), torch.tensor(1.0)).timesteps
    assert steps.shape[1] == state.denoise_mask.shape[1] and set(steps.unique().tolist()) == {0.25, 1.0}


def test_one_for_every_token_leaves_single_token_and_flat_masks_alone() -> None:
    single = torch.ones(1, 1, 1)
    assert one_for_every_token(single) is single
    flat = torch.ones(3)
    assert one_for_every_token(flat) is flat
