"""Host work taken out of the LTX-2 transformer forward, so a denoising step can run without the host in
the loop and be captured in a CUDA graph (`cuda_graph.py`).

What ltx-core's forward does on every call that a step loop does not need to redo (found by
`graph_audit.HostSyncAudit`; `tests/test_graph_ready.py` keeps the list honest):

- RoPE frequency grid: built on the CPU and copied to the device four times per forward (video, audio, two
  cross-attention tables): host->device copies that synchronise the stream and break capture. Here: kept on
  the device once per (theta, sizes, device).
- RoPE cos/sin of the positions: recomputed every step although positions are fixed for a stage. Here:
  part of the cached `ModalityGeometry`.
- self-attention mask -> bias: `if positive.any()` and boolean indexing (a host sync and data-dependent
  shapes). Here: `self_attention_bias`, one `where`, cached with the geometry.
- perturbation masks: a Python loop and a small tensor per block, twice per block. Here:
  `cached_perturbations`, made once per set of passes.
- SP padding: padded positions and the key mask rebuilt per forward. Here: part of the geometry.

Caches are keyed by the identity of the input tensors and step aside under CUDA-graph capture
(`capture_cache.py` says how and why). Shared with the eager path are only constants that are never evicted:
the device copy of the RoPE frequency grid, and the perturbation masks of a configuration (functions of
the configuration alone; ltx-core builds them with per-row scalar writes, host->device copies that capture
refuses), both made by the eager forward that precedes every capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sharding.partition import pad_modality_for_uniform_sharding, tile_modality_for_rank
from .capture_cache import IdentityCache, capturing

__all__ = [
    "ForwardHoister",
    "HoistedArgsPreprocessor",
    "ModalityGeometry",
    "cached_perturbations",
    "perturbation_signature",
    "self_attention_bias",
]

# =========================================================================================================
# Sync-free pieces
# =========================================================================================================

_DEVICE_GRIDS: dict[tuple[Any, ...], torch.Tensor] = {}


def _device_grid(generator: Callable[..., torch.Tensor], device: torch.device) -> Callable[..., torch.Tensor]:
    """ltx-core's RoPE frequency-grid generator, answering with a device tensor kept for the process's
    lifetime (ltx-core caches it on the CPU and copies it to the device on every forward)."""

    def grid(theta: float, count: int, dim: int, *_: Any) -> torch.Tensor:
        key = (generator, float(theta), int(count), int(dim), device)
        out = _DEVICE_GRIDS.get(key)
        if out is None:
            out = _DEVICE_GRIDS[key] = generator(theta, count, dim).to(device)
        return out

    return grid


def self_attention_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """ltx-core's [0, 1] self-attention mask -> additive log-space bias (B, 1, ...) without a host sync:
    0 and below -> the dtype's minimum, positive values -> log(value) (clamped at the smallest normal)."""
    if mask is None:
        return None
    finfo = torch.finfo(dtype)
    logs = torch.log(mask.clamp(min=finfo.tiny)).to(dtype)
    floor = torch.full((), finfo.min, dtype=dtype, device=mask.device)
    return torch.where(mask > 0, logs, floor).unsqueeze(1)


# =========================================================================================================
# Perturbation masks
# =========================================================================================================


def perturbation_signature(batched: Any) -> Hashable:
    """A hashable summary of a `BatchedPerturbationConfig` (what the masks depend on)."""
    rows = []
    for config in batched.perturbations:
        items = config.perturbations
        rows.append(
            None if items is None else tuple((p.type, None if p.blocks is None else tuple(p.blocks)) for p in items)
        )
    return tuple(rows)


def _cached_perturbations_class() -> type:
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    @dataclass(frozen=True)
    class CachedPerturbations(BatchedPerturbationConfig):
        """A `BatchedPerturbationConfig` that makes each per-block mask once (the block asks twice per
        forward, with a Python loop over the batch each time). Under capture it answers with the masks made
        eagerly (constants of the configuration) and never makes one."""

        _cache: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)

        def mask(self, perturbation_type: Any, block: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
            key = ("mask", perturbation_type, block, torch.device(device), dtype)
            out = self._cache.get(key)
            if out is None and capturing():  # not made eagerly: ltx-core's own (uncapturable) construction
                return super().mask(perturbation_type, block, device, dtype)
            if out is None:
                out = self._cache[key] = super().mask(perturbation_type, block, device, dtype)
            return out

        def any_in_batch(self, perturbation_type: Any, block: int) -> bool:
            key = ("any", perturbation_type, block)
            if key not in self._cache:
                self._cache[key] = super().any_in_batch(perturbation_type, block)
            return self._cache[key]

        def all_in_batch(self, perturbation_type: Any, block: int) -> bool:
            key = ("all", perturbation_type, block)
            if key not in self._cache:
                self._cache[key] = super().all_in_batch(perturbation_type, block)
            return self._cache[key]

    return CachedPerturbations


_CACHED_PERTURBATIONS: list[type] = []


def cached_perturbations(perturbations: list[Any]) -> Any:
    """A mask-caching `BatchedPerturbationConfig` over `perturbations` (the class is made on first use:
    it subclasses an ltx-core type)."""
    if not _CACHED_PERTURBATIONS:
        _CACHED_PERTURBATIONS.append(_cached_perturbations_class())
    return _CACHED_PERTURBATIONS[0](perturbations)


# =========================================================================================================
# Geometry: everything position- and mask-dependent of one modality on one rank
# =========================================================================================================


@dataclass
class ModalityGeometry:
    """What one modality's positions and mask give this rank (constant over a denoising stage). Holds no
    view of the caller's tensors: without padding the model gets the step's own positions and mask."""

    padded_positions: torch.Tensor | None  #: this rank's slice of the padded positions (None: no padding)
    padded_mask: torch.Tensor | None  #: the padded or key-only mask (None: the step's own mask, if any)
    positions_shape: tuple[int, ...]  #: shape of the positions the model sees on this rank
    pe: tuple[torch.Tensor, torch.Tensor]  #: RoPE (cos, sin) of those positions
    cross_pe: tuple[torch.Tensor, torch.Tensor] | None  #: RoPE of the audio-video cross attention
    self_attention_bias: torch.Tensor | None  #: additive bias from the mask the model sees
    original_len: int  #: real tokens of the modality
    padded_len: int  #: tokens after padding to a multiple of the world size
    counts: list[int]  #: per-rank token counts (uniform)
    start: int  #: this rank's first token
    end: int

    @property
    def padded(self) -> bool:
        return self.padded_len != self.original_len

    def positions(self, modality: Any) -> torch.Tensor:
        """The positions the model sees this step: the padded slice, or the step's own slice."""
        if self.padded_positions is not None:
            return self.padded_positions
        return modality.positions.narrow(2, self.start, self.end - self.start)

    def attention_mask(self, modality: Any) -> torch.Tensor | None:
        return self.padded_mask if self.padded else modality.attention_mask


class HoistedArgsPreprocessor:
    """Stands in for ltx-core's (MultiModal)TransformerArgsPreprocessor on the model: when the forward was
    bound to a `ModalityGeometry` for this modality (by `ForwardHoister.bind`), the position- and
    mask-dependent arguments come from it; everything else is ltx-core's own code. Unbound calls go to the
    original preprocessor unchanged."""

    def __init__(self, original: Any, hoister: ForwardHoister, role: str) -> None:
        self.original = original
        self.hoister = hoister
        self.role = role

    @property
    def simple(self) -> Any:
        return getattr(self.original, "simple_preprocessor", self.original)

    def prepare(self, modality: Any, cross_modality: Any = None) -> Any:
        geo = self.hoister.bound(self.role)
        if geo is None or tuple(modality.positions.shape) != geo.positions_shape:
            return self.original.prepare(modality, cross_modality)
        from ltx_core.model.transformer.transformer_args import TransformerArgs

        simple = self.simple
        dtype = modality.latent.dtype
        x = simple.patchify_proj(modality.latent)
        batch = x.shape[0]
        timestep, embedded = simple._prepare_timestep(modality.timesteps, simple.adaln, batch, dtype)
        prompt_timestep = None
        if simple.prompt_adaln is not None:
            prompt_timestep, _ = simple._prepare_timestep(modality.sigma, simple.prompt_adaln, batch, dtype)
        args = TransformerArgs(
            x=x,
            context=simple._prepare_context(modality.context, x),
            context_mask=simple._prepare_attention_mask(modality.context_mask, dtype),
            timesteps=timestep,
            embedded_timestep=embedded,
            positional_embeddings=geo.pe,
            cross_positional_embeddings=None,
            cross_scale_shift_timestep=None,
            cross_gate_timestep=None,
            enabled=modality.enabled,
            prompt_timestep=prompt_timestep,
            self_attention_mask=geo.self_attention_bias,
        )
        if cross_modality is None or simple is self.original:
            return args
        sigma = cross_modality.sigma
        if sigma.numel() > 1 and (sigma.shape[0] != modality.timesteps.shape[0] or sigma.ndim != 1):
            return self.original.prepare(modality, cross_modality)  # let ltx-core raise its own error
        cross_timestep = sigma.view(modality.timesteps.shape[0], 1, *[1] * len(modality.timesteps.shape[2:]))
        scale_shift, gate = self.original._prepare_cross_attention_timestep(
            timestep=cross_timestep,
            timestep_scale_multiplier=simple.timestep_scale_multiplier,
            batch_size=batch,
            hidden_dtype=dtype,
        )
        return dataclasses.replace(
            args,
            cross_positional_embeddings=geo.cross_pe,
            cross_scale_shift_timestep=scale_shift,
            cross_gate_timestep=gate,
        )

    # ---- geometry -----------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype: torch.dtype, *, cross: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """ltx-core's RoPE for `positions` (rows that share positions are computed once and expanded)."""
        from ltx_core.model.transformer import transformer_args as ta

        simple = self.simple
        rows = positions.shape[0]
        if rows > 1 and positions.stride(0) == 0:
            positions = positions[:1]
        if cross:
            positions = positions[:, 0:1, :]
            dim, max_pos, middle = self.original.audio_cross_attention_dim, [self.original.cross_pe_max_pos], True
        else:
            dim, max_pos, middle = simple.inner_dim, simple.max_pos, simple.use_middle_indices_grid
        base = ta.generate_freq_grid_np if simple.double_precision_rope else ta.generate_freq_grid_pytorch
        cos, sin = ta.precompute_freqs_cis(
            positions,
            dim=dim,
            out_dtype=dtype,
            theta=simple.positional_embedding_theta,
            max_pos=max_pos,
            use_middle_indices_grid=middle,
            num_attention_heads=simple.num_attention_heads,
            rope_type=simple.rope_type,
            freq_grid_generator=_device_grid(base, positions.device),
        )
        if cos.shape[0] != rows:
            cos, sin = cos.expand(rows, *cos.shape[1:]), sin.expand(rows, *sin.shape[1:])
        return cos, sin


class ForwardHoister:
    """Installs `HoistedArgsPreprocessor`s on an LTX-2 model and prepares, caches and binds the per-stage
    geometry of its inputs (see the module docstring). One per SP wrapper."""

    def __init__(self, model: torch.nn.Module, *, capacity: int = 8) -> None:
        self._bound: dict[str, ModalityGeometry] = {}
        self.preprocessors: dict[str, HoistedArgsPreprocessor] = {}
        for role, attr in (("video", "video_args_preprocessor"), ("audio", "audio_args_preprocessor")):
            original = getattr(model, attr, None)
            if original is None:
                continue
            if isinstance(original, HoistedArgsPreprocessor):  # installed twice: keep the first
                original = original.original
            pre = HoistedArgsPreprocessor(original, self, role)
            setattr(model, attr, pre)  # a plain attribute in ltx-core (not a submodule)
            self.preprocessors[role] = pre
        self.geometries = IdentityCache(capacity)
        self._perturbations: OrderedDict[Hashable, Any] = OrderedDict()
        self.perturbation_capacity = 16
        # configurations whose masks a captured graph reads (by address): never evicted, so a replay can
        # never read freed memory; bounded by the graphs a wrapper keeps
        self._captured_perturbations: dict[Hashable, Any] = {}

    # ---- geometry -----------------------------------------------------------------------------------
    def geometry(self, role: str, modality: Any, world_size: int = 1, rank: int = 0) -> ModalityGeometry:
        """This rank's geometry of `modality` (SP-sliced when world_size > 1), cached per input tensors."""
        dtype = modality.latent.dtype
        key = (role, world_size, rank, dtype, tuple(modality.latent.shape))
        return self.geometries.get(
            (modality.positions, modality.attention_mask),
            key,
            lambda: self._compute(role, modality, world_size, rank),
        )

    def compute_geometry(self, role: str, modality: Any) -> ModalityGeometry:
        """The unsliced geometry of `modality`, not cached here: for a caller that keeps its own (the tiled
        wrapper makes one per tile and job)."""
        return self._compute(role, modality, 1, 0)

    def _compute(self, role: str, modality: Any, world_size: int, rank: int) -> ModalityGeometry:
        pre = self.preprocessors[role]
        dtype = modality.latent.dtype
        if world_size > 1:
            padded, original_len = pad_modality_for_uniform_sharding(modality, world_size)
            tile, counts = tile_modality_for_rank(padded, rank, world_size)
        else:
            tile, original_len, counts = modality, modality.latent.shape[1], [modality.latent.shape[1]]
        padded_len = sum(counts)
        start = sum(counts[:rank])
        cross = pre.simple is not pre.original
        padded = padded_len != original_len  # then tile's positions and mask are new tensors, not views
        return ModalityGeometry(
            padded_positions=tile.positions if padded else None,
            padded_mask=tile.attention_mask if padded else None,
            positions_shape=tuple(tile.positions.shape),
            pe=pre.rope(tile.positions, dtype, cross=False),
            cross_pe=pre.rope(tile.positions, dtype, cross=True) if cross else None,
            self_attention_bias=self_attention_bias(tile.attention_mask, dtype),
            original_len=int(original_len),
            padded_len=int(padded_len),
            counts=[int(c) for c in counts],
            start=int(start),
            end=int(start + counts[rank]),
        )

    @contextlib.contextmanager
    def bind(self, **geometries: ModalityGeometry | None) -> Iterator[None]:
        """Within the block, the model's preprocessors use these geometries (role -> geometry)."""
        previous = dict(self._bound)
        self._bound.update({role: geo for role, geo in geometries.items() if geo is not None})
        try:
            yield
        finally:
            self._bound = previous

    def bound(self, role: str) -> ModalityGeometry | None:
        return self._bound.get(role)

    # ---- perturbations ------------------------------------------------------------------------------
    def perturbations(self, batched: Any) -> Any:
        """A mask-caching equivalent of `batched`, reused for every later call with the same configuration."""
        if batched is None:
            return batched
        key = perturbation_signature(batched)
        cached = self._perturbations.get(key) or self._captured_perturbations.get(key)
        if capturing():
            # The masks made by the eager warm-up forward of this very configuration are constants of the
            # configuration: the graph reads them (ltx-core builds a mask with per-row scalar writes, a
            # host->device copy that capture refuses). Without an eager forward before, ltx-core's path runs
            # and the capture fails (the wrapper then stays eager for this shape).
            if cached is None:
                return batched
            self._captured_perturbations[key] = cached
            return cached
        if cached is None:
            cached = self._perturbations[key] = cached_perturbations(list(batched.perturbations))
            while len(self._perturbations) > self.perturbation_capacity:
                self._perturbations.popitem(last=False)
        self._perturbations.move_to_end(key)
        return cached


def slice_tokens(t: torch.Tensor, pad: int, start: int, end: int, dim: int = 1) -> torch.Tensor:
    """Pad `t` with zeros along `dim` by `pad` tokens, then take tokens [start, end) (a view when no
    padding is needed)."""
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    return t.narrow(dim, start, end - start)
