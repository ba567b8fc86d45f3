"""The `dist` all2all backend: head exchange over `torch.distributed.all_to_all_single`.

Works over any process group that implements all_to_all (gloo on CPU, NCCL on CUDA). It is the portable
fallback and the reference the `ipc` kernel is compared with byte for byte. It moves bytes only: no dtype
conversion, no arithmetic, so a send/gather round trip is exact.

When the group is gloo and the tensors live on a GPU (several ranks oversubscribed on one GPU, where NCCL
refuses to run), the exchange is staged through host memory: correct, not fast. That mode exists for
tests; real multi-GPU runs use NCCL or `ipc`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..all2all import register_backend

__all__ = ["DistAll2All", "create_dist_backend"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistAll2All:
    """One exchange channel (one tensor role) over a process group; see `all2all.py` for the contract."""

    requires_barrier_after_set_tokens = False  # collectives synchronise by themselves

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        max_tokens_per_rank: int,
        hidden_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float | None = None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.hidden_dim = int(hidden_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        # Stage through the host when the group cannot move this device's tensors (gloo + CUDA).
        self._stage_on_host = dist.get_backend(group) == "gloo" and self.device.type != "cpu"
        self._tokens: list[int] = []
        self._destroyed = False

    # ---- runtime state -------------------------------------------------------------------------------
    def set_rank_tokens(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if len(tokens) != self.world_size or any(t < 0 for t in tokens):
            raise ValueError(f"set_rank_tokens needs {self.world_size} non-negative counts, got {tokens}")
        self._tokens = tokens

    def set_timeout_seconds(self, seconds: float) -> None:
        self.timeout_s = float(seconds)  # collectives use the process group's own timeout

    # ---- exchanges -----------------------------------------------------------------------------------
    def send_recv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S_local, H, D) -> (B, S_total, H/w, D)."""
        self._check(x)
        w = self.world_size
        b, s_local, h, d = x.shape
        if h % w:
            raise ValueError(f"heads ({h}) must be divisible by world_size ({w})")
        tokens = self._tokens_for(s_local)
        hw = h // w
        # Chunk j (rank j's heads of my tokens) must be contiguous: (w, B, S_local, H/w, D).
        send = x.reshape(b, s_local, w, hw, d).permute(2, 0, 1, 3, 4).contiguous().reshape(-1)
        row = b * hw * d
        recv = self._exchange(send, [s_local * row] * w, [t * row for t in tokens])
        if w == 1:
            return recv.view(b, s_local, hw, d)
        parts = torch.split(recv, [t * row for t in tokens])
        return torch.cat([p.view(b, t, hw, d) for p, t in zip(parts, tokens, strict=True)], dim=1)

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S_total, H/w, D) -> (B, S_local, H, D)."""
        self._check(x)
        w = self.world_size
        b, s_total, hw, d = x.shape
        tokens = self._tokens
        if not tokens or sum(tokens) != s_total:
            if s_total % w:
                raise RuntimeError(f"gather_heads got {s_total} tokens but set_rank_tokens was {tokens}")
            tokens = [s_total // w] * w  # uniform default when counts were never set
        s_local = tokens[self.rank]
        row = b * hw * d
        # Chunk j (rank j's tokens, my heads) contiguous: per-rank slices of the token dim, flattened.
        send = torch.cat([p.reshape(-1) for p in torch.split(x, tokens, dim=1)]) if w > 1 else x.reshape(-1)
        recv = self._exchange(send.contiguous(), [t * row for t in tokens], [s_local * row] * w)
        return recv.view(w, b, s_local, hw, d).permute(1, 2, 0, 3, 4).reshape(b, s_local, w * hw, d)

    def all_gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H/w, D) -> (B, S, H, D); rank r's slice lands in heads [r*H/w, (r+1)*H/w)."""
        self._check(x)
        w = self.world_size
        b, s, hw, d = x.shape
        src = x.contiguous()
        if w == 1:
            return src.clone()
        on_host = self._stage_on_host and src.device.type != "cpu"
        inp = (src.cpu() if on_host else src).reshape(-1).view(torch.uint8)  # raw bytes, any dtype
        out = torch.empty(w * inp.numel(), dtype=torch.uint8, device=inp.device)
        _all_gather_single(out, inp, group=self.group)
        out = out.view(x.dtype).view(w, b, s, hw, d)
        if on_host:
            out = out.to(src.device)
        return out.permute(1, 2, 0, 3, 4).reshape(b, s, w * hw, d)

    def destroy(self) -> None:
        self._destroyed = True
        self._tokens = []

    # ---- helpers -------------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        if self._destroyed:
            raise RuntimeError("DistAll2All used after destroy()")
        if x.dim() != 4:
            raise ValueError(f"all2all expects a (B, S, H, D) tensor, got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"all2all built for {self.dtype}, got {x.dtype}")

    def _tokens_for(self, s_local: int) -> list[int]:
        tokens = self._tokens
        if not tokens:
            return [s_local] * self.world_size  # uniform default when counts were never set
        if tokens[self.rank] != s_local:
            raise RuntimeError(
                f"send_recv_heads got {s_local} local tokens on rank {self.rank}, set_rank_tokens said {tokens}"
            )
        return tokens

    def _exchange(self, send: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        """all_to_all_single on a flat tensor, moved as raw bytes so every dtype (fp8 too) works on every
        process-group backend and nothing can be converted on the way."""
        if self.world_size == 1:
            return send.clone()
        item = send.element_size()
        on_host = self._stage_on_host and send.device.type != "cpu"
        src = (send.cpu() if on_host else send).view(torch.uint8)
        recv = torch.empty(sum(out_splits) * item, dtype=torch.uint8, device=src.device)
        dist.all_to_all_single(
            recv, src, [n * item for n in out_splits], [n * item for n in in_splits], group=self.group
        )
        recv = recv.view(send.dtype)
        return recv.to(send.device) if on_host else recv


def create_dist_backend(
    *,
    group: dist.ProcessGroup | None,
    max_tokens_per_rank: int,
    hidden_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    timeout_s: float | None = None,
) -> DistAll2All:
    """Factory registered as "dist" (same keyword signature every backend factory has)."""
    return DistAll2All(
        group=group,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden_dim=hidden_dim,
        dtype=dtype,
        device=device,
        timeout_s=timeout_s,
    )


register_backend("dist", create_dist_backend)
