"""`AttentionManager` (the all2all channels of one SP transformer) and the attention callables that
route LTX-2's video self-attention and audio-queries-over-video cross-attention through them.

Where SP exchanges heads (everything else in a block runs on the rank's local video slice):

| attention             | Q                   | K, V                | what crosses ranks                           |
|-----------------------|---------------------|---------------------|----------------------------------------------|
| `attn1` (video self)  | local video slice   | local video slice   | Q, K, V: send_recv_heads; output: gather_heads |
| `video_to_audio_attn` | audio (replicated)  | local video slice   | K, V: send_recv_heads; output: all_gather_heads |
| `audio_to_video_attn` | local video slice   | audio (replicated)  | nothing                                      |
| `attn2`, audio attns  | local / replicated  | text / replicated   | nothing                                      |

ltx-core 1.0.0's `Attention` has a single `attention_function` slot that receives the mask (None when the
caller has none), so each callable handles both the masked and the unmasked call; newer ltx-core versions
with a separate `masked_attention_function` slot get the same callable there (see `builder.py`).

Padding: the SP wrapper pads the video sequence to a multiple of the world size. Video self-attention sees
the padding through the self-attention mask the wrapper attaches. The audio cross-attention receives no
mask from the model, so its callable masks the padded video keys itself (`AttentionManager.valid_tokens`);
without that, audio queries would attend to padding and SP would not be faithful when the token count is
not divisible by the world size.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..graphs.capture_cache import capturing
from ..sharding.collectives import collective_device
from .all2all import (
    All2AllBackend,
    all_gather_heads,
    gather_heads,
    get_backend_factory,
    ipc_is_available,
    register_runtime,
    send_recv_heads,
    unregister_runtime,
)

__all__ = ["DEFAULT_ALL2ALL_TIMEOUT_S", "All2AllAttention", "AttentionManager", "AudioAll2AllAttention"]

DEFAULT_ALL2ALL_TIMEOUT_S = 10.0
_ROLES = ("q", "k", "v", "heads")


def _check_heads(heads: int, world_size: int) -> None:
    if heads % world_size:
        raise ValueError(f"heads ({heads}) must be divisible by world_size ({world_size})")


def _destroy_backends(backends: list[All2AllBackend], comm_ids: list[int]) -> None:
    for comm_id in comm_ids:
        unregister_runtime(comm_id)
    for backend in backends:
        try:
            backend.destroy()
        except Exception:  # finalizer: never raise during interpreter shutdown
            pass


class AttentionManager:
    """The all2all channels (q, k, v, heads) of one SP transformer, plus the per-forward runtime state.

    Args:
        max_tokens: upper bound on the padded video token count of one forward (times the batch size);
            each channel holds `ceil(max_tokens / world_size)` tokens of `num_heads * head_dim` values.
        num_heads, head_dim: the video self-attention geometry (LTX-2 19B: 32 x 128).
        tensor_dtype: activation dtype exchanged (bf16 in production, fp32 in numerics tests).
        group: the transformer process group (None = the default group).
        backend: "auto" (ipc on CUDA when available on every rank, else dist), or a registered name.
        device: this rank's device. Defaults to the bound CUDA device for NCCL groups and the CPU
            otherwise; it is never derived from the rank number.
        timeout_s: the exchange barrier timeout handed to the backend (`all2all_timeout_seconds`).
        local: a manager for this rank alone (world size 1, no group, no channels) whatever the process
            group says: what a layout with S = 1 (guidance parallelism only) uses.
        zero_copy: ask each channel for views of its exchange buffer instead of copies (backends with a
            `set_zero_copy`; the ipc kernel). Safe here: the attention callables consume every output
            before its role exchanges again (`backends/ipc.py`).

    Construction is collective (every rank, same order): `num_heads % world_size != 0` raises
    `ValueError` on every rank before any collective.
    """

    def __init__(
        self,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        tensor_dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        *,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_ALL2ALL_TIMEOUT_S,
        local: bool = False,
        zero_copy: bool = True,
    ) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        # Without a process group (a single process, e.g. a notebook) SP degenerates to world size 1.
        rank, world_size = (0, 1)
        if dist.is_initialized() and not local:
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if local:
            group = None
        _check_heads(num_heads, world_size)
        _check_timeout(timeout_s)
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.max_tokens = int(max_tokens)
        self.max_tokens_per_rank = math.ceil(max_tokens / self.world_size)
        self.num_heads = int(num_heads)
        self.head_dim = int(head_dim)
        self.hidden_dim = self.num_heads * self.head_dim
        self.tensor_dtype = tensor_dtype
        # (a local manager has group None: it follows the fleet's default group, as the world manager does)
        self.device = _default_device(group) if device is None else torch.device(device)
        self._timeout_s = float(timeout_s)
        self.backend_name = self._resolve_backend(backend)
        # Runtime state of the current forward (set by the SP wrapper on every rank).
        self.rank_tokens: list[int] = []
        self.valid_tokens: int | None = None  #: real (unpadded) video tokens; keys past it are padding
        self.mask_audio_padding = True  #: False only in tests that prove the audio padding mask matters
        self._key_bias_cache: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

        self._backends: dict[str, All2AllBackend] = {}
        self.comm_ids: dict[str, int] = {}
        if self.world_size > 1:  # world 1: the callables run the inner attention directly
            factory = get_backend_factory(self.backend_name)
            for role in _ROLES:  # same order on every rank: factories may be collective
                inst = factory(
                    group=group,
                    max_tokens_per_rank=self.max_tokens_per_rank,
                    hidden_dim=self.hidden_dim,
                    dtype=tensor_dtype,
                    device=self.device,
                    timeout_s=self._timeout_s,
                )
                setter = getattr(inst, "set_zero_copy", None)
                if setter is not None:
                    setter(bool(zero_copy))
                self._backends[role] = inst
                self.comm_ids[role] = register_runtime(inst)
        self._barrier_after_tokens = any(
            getattr(b, "requires_barrier_after_set_tokens", False) for b in self._backends.values()
        )
        self._finalizer = weakref.finalize(
            self, _destroy_backends, list(self._backends.values()), list(self.comm_ids.values())
        )

    # ---- backend choice ------------------------------------------------------------------------------
    def _resolve_backend(self, backend: str) -> str:
        if backend != "auto":
            return backend
        if self.world_size == 1:
            return "dist"
        ok = ipc_is_available(self.device)
        # Every rank must pick the same backend (construction is collective): agree on the minimum.
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(self.group, self.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return "ipc" if int(flag.item()) == 1 else "dist"

    @property
    def channels(self) -> dict[str, All2AllBackend]:
        """Role ("q", "k", "v", "heads") -> backend instance (empty at world size 1)."""
        return dict(self._backends)

    # ---- per-forward runtime state -------------------------------------------------------------------
    def set_rank_tokens(self, tokens: Sequence[int], valid_tokens: int | None = None) -> None:
        """Per-rank local video token counts of this forward (and how many of their sum are real).

        Runtime state, not an op argument: changing it does not recompile a compiled model. Called by the
        SP wrapper on every rank before the model runs.
        """
        tokens = [int(t) for t in tokens]
        if len(tokens) != self.world_size:
            raise ValueError(f"set_rank_tokens needs {self.world_size} counts, got {tokens}")
        self.rank_tokens = tokens
        self.valid_tokens = sum(tokens) if valid_tokens is None else int(valid_tokens)
        for inst in self._backends.values():
            inst.set_rank_tokens(tokens)
        if self._barrier_after_tokens:
            dist.barrier(group=self.group)

    def key_padding_bias(self, total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """(1, 1, 1, total) additive bias that removes padded video keys, or None without padding.

        Kept between forwards of the same geometry; made afresh (in the graph's pool) under capture."""
        valid = self.valid_tokens
        if not self.mask_audio_padding or valid is None or valid >= total:
            return None
        key = (total, valid, dtype, device)
        bias = None if capturing() else self._key_bias_cache.get(key)
        if bias is None:
            bias = torch.zeros((1, 1, 1, total), dtype=dtype, device=device)
            bias[..., valid:] = torch.finfo(dtype).min
            if not capturing():
                self._key_bias_cache = {key: bias}  # one forward's geometry at a time
        return bias

    # ---- timeout -------------------------------------------------------------------------------------
    @property
    def all2all_timeout_seconds(self) -> float:
        return self._timeout_s

    @all2all_timeout_seconds.setter
    def all2all_timeout_seconds(self, seconds: float) -> None:
        """Raise it around a first `torch.compile` forward (one rank's recompile can delay its launch),
        then set it back. Every backend validates before the stored value changes."""
        _check_timeout(seconds)
        for inst in self._backends.values():
            setter = getattr(inst, "set_timeout_seconds", None)
            if setter is not None:
                setter(float(seconds))
        self._timeout_s = float(seconds)

    # ---- lifetime ------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Free every channel (idempotent; also runs when the manager is garbage collected)."""
        self._finalizer()
        self._backends = {}
        self.comm_ids = {}

    def __repr__(self) -> str:
        return (
            f"AttentionManager(rank={self.rank}, world_size={self.world_size}, backend={self.backend_name!r}, "
            f"max_tokens={self.max_tokens}, heads={self.num_heads}x{self.head_dim}, dtype={self.tensor_dtype}, "
            f"device={self.device})"
        )


def _check_timeout(seconds: float) -> None:
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"all2all timeout seconds must be finite and non-negative, got {seconds}")


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # the device the fleet bound
    return torch.device("cpu")


# =========================================================================================================
# Attention callables (drop-in for ltx-core's AttentionCallable: (q, k, v, heads, mask) -> out)
# =========================================================================================================


class All2AllAttention:
    """Video self-attention over the whole sequence while each rank holds a contiguous token slice.

    q, k, v: (B, S_local, H*D) -> exchange heads -> (B, S_total, H/w*D) -> `inner` on H/w heads with the
    full-sequence mask -> gather heads back -> (B, S_local, H*D).
    """

    def __init__(self, manager: AttentionManager, inner: Any) -> None:
        self.manager = manager
        self.inner = inner

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        mgr = self.manager
        w = mgr.world_size
        if w == 1:
            return self.inner(q, k, v, heads, mask)
        _check_heads(heads, w)
        b, s, hidden = q.shape
        d = hidden // heads
        ids = mgr.comm_ids
        qa = send_recv_heads(q.reshape(b, s, heads, d), ids["q"], w)
        ka = send_recv_heads(k.reshape(b, s, heads, d), ids["k"], w)
        va = send_recv_heads(v.reshape(b, s, heads, d), ids["v"], w)
        s_total = qa.shape[1]
        hw = heads // w
        out = self.inner(
            qa.reshape(b, s_total, hw * d), ka.reshape(b, s_total, hw * d), va.reshape(b, s_total, hw * d), hw, mask
        )
        out = gather_heads(out.reshape(b, s_total, hw, d), ids["heads"], w)
        return out.reshape(b, s, hidden)

    def __repr__(self) -> str:
        return f"All2AllAttention(world_size={self.manager.world_size}, inner={self.inner!r})"


class AudioAll2AllAttention:
    """Audio queries (replicated on every rank) over the video keys/values (sharded).

    Q is sliced locally to this rank's heads; K and V exchange heads so this rank sees every video token
    for its heads; padded video keys are masked; the per-rank outputs are all-gathered along heads.
    """

    def __init__(self, manager: AttentionManager, inner: Any) -> None:
        self.manager = manager
        self.inner = inner

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        mgr = self.manager
        w = mgr.world_size
        if w == 1:
            return self.inner(q, k, v, heads, mask)
        _check_heads(heads, w)
        b, sq, hidden = q.shape
        sk = k.shape[1]
        d = hidden // heads
        hw = heads // w
        lo = mgr.rank * hw
        ids = mgr.comm_ids
        q_local = q.reshape(b, sq, heads, d)[:, :, lo : lo + hw].reshape(b, sq, hw * d)
        ka = send_recv_heads(k.reshape(b, sk, heads, d), ids["k"], w)
        va = send_recv_heads(v.reshape(b, sk, heads, d), ids["v"], w)
        s_total = ka.shape[1]
        bias = _merge_key_masks(mask, mgr.key_padding_bias(s_total, q.dtype, q.device), s_total, q.dtype)
        out = self.inner(q_local, ka.reshape(b, s_total, hw * d), va.reshape(b, s_total, hw * d), hw, bias)
        out = all_gather_heads(out.reshape(b, sq, hw, d), ids["heads"], w)
        return out.reshape(b, sq, hidden)

    def __repr__(self) -> str:
        return f"AudioAll2AllAttention(world_size={self.manager.world_size}, inner={self.inner!r})"


def _merge_key_masks(
    mask: torch.Tensor | None, padding_bias: torch.Tensor | None, total: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """Combine a caller's mask over the real video keys with the padding bias over all `total` keys.

    A caller mask (additive bias, ..., S_k_real) is extended with fully-masked padded key columns.
    """
    if mask is None:
        return padding_bias
    if mask.shape[-1] < total:
        shape = (*mask.shape[:-1], total - mask.shape[-1])
        pad = torch.full(shape, torch.finfo(dtype).min, dtype=mask.dtype, device=mask.device)  # no host copy
        mask = torch.cat([mask, pad], dim=-1)
    if padding_bias is None:
        return mask
    return (mask + padding_bias.to(mask.dtype)).clamp(min=torch.finfo(mask.dtype).min)  # no -inf rows
