"""Distributed prompt encoding: the text encoder (Gemma + LTX-2 embeddings processor: tens of GB) runs on
one source rank and its outputs are broadcast, so the other ranks never load it; or, for several prompts
(CFG positive + negative), every rank holds a replica and encodes its share (batch parallel).

Both classes are collective (every rank of `group`, same order) and model-agnostic: they drive any local
encoder with the `LocalPromptEncoder` protocol (`ltx_mgpu.runners.ltx2.text.GemmaPromptEncoder` is the
LTX-2 one). An encoding is a dict of named tensors (or None entries), e.g. {"video": (1, T, D),
"audio": (1, T, Da), "mask": (1, T)}.

Failure symmetry: an exception in the local encoder (e.g. a prompt the tokenizer rejects) is caught on the
encoding rank and announced in the metadata broadcast that precedes every transfer, so *every* rank
raises the same `RunnerError` and nobody waits for tensors that will never come (the fleet survives).
Waits are bounded by the group's timeout (they are collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..errors import RunnerError
from .collectives import needs_host_staging

__all__ = ["BatchParallelPromptEncoder", "DistributedPromptEncoder", "LocalPromptEncoder", "broadcast_encodings"]

Encoding = dict[str, torch.Tensor | None]


class LocalPromptEncoder(Protocol):
    """What a rank-local encoder provides."""

    def encode(self, prompts: Sequence[str]) -> list[Encoding]: ...

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str: ...


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)}


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def broadcast_encodings(
    encodings: list[Encoding] | None,
    error: str | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[Encoding]:
    """Collective: rank `src` (group rank) sends `encodings` (or an `error`), every rank returns them on
    `device`. Metadata (names, shapes, dtypes, or the error) goes first as one object broadcast."""
    me = dist.get_rank(group)
    header: list[Any] = [None]
    if me == src:
        if error is not None:
            header[0] = {"error": error}
        else:
            assert encodings is not None
            header[0] = {
                "items": [
                    {k: (None if v is None else (tuple(v.shape), str(v.dtype))) for k, v in enc.items()}
                    for enc in encodings
                ]
            }
    dist.broadcast_object_list(header, src=_global(group, src), group=group)
    meta = header[0]
    if "error" in meta:
        raise RunnerError(f"text encoder failed on rank {src}: {meta['error']}")
    staged = needs_host_staging(group, device)
    out: list[Encoding] = []
    for i, item in enumerate(meta["items"]):
        enc: Encoding = {}
        for name, spec in item.items():
            if spec is None:
                enc[name] = None
                continue
            shape, dtype = spec
            if me == src:
                assert encodings is not None
                value = encodings[i][name]
                assert value is not None
                buf = value.detach().to(device).contiguous()
                wire = buf.cpu() if staged else buf.clone()
            else:
                wire = torch.empty(shape, dtype=_DTYPES[dtype], device="cpu" if staged else device)
            dist.broadcast(wire, src=_global(group, src), group=group)
            enc[name] = wire.to(device) if staged else wire
        out.append(enc)
    return out


def _broadcast_text(text: str | None, error: str | None, *, src: int, group: dist.ProcessGroup | None) -> str:
    box: list[Any] = [{"text": text, "error": error}]
    dist.broadcast_object_list(box, src=_global(group, src), group=group)
    if box[0]["error"] is not None:
        raise RunnerError(f"prompt enhancement failed on rank {src}: {box[0]['error']}")
    return str(box[0]["text"])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class DistributedPromptEncoder:
    """The encoder lives on `src_rank` only; every rank gets every encoding.

    Args:
        encoder: the local encoder on the source rank; None on the others.
        group: the process group to broadcast over (the fleet's gemma group).
        src_rank: group rank that holds the encoder.
        device: where the received tensors go on this rank.
    """

    def __init__(
        self,
        encoder: LocalPromptEncoder | None,
        *,
        group: dist.ProcessGroup | None,
        device: torch.device | str,
        src_rank: int = 0,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if not 0 <= src_rank < self.world_size:
            raise ValueError(f"src_rank {src_rank} is outside the group (size {self.world_size})")
        self.src_rank = src_rank
        self.device = torch.device(device)
        if (self.rank == src_rank) != (encoder is not None):
            raise ValueError("the encoder must be given on the source rank and only there")
        self.encoder = encoder

    def encode(self, prompts: Sequence[str]) -> list[Encoding]:
        """Collective: one encoding per prompt, identical on every rank."""
        encodings, error = None, None
        if self.encoder is not None:
            try:
                encodings = self.encoder.encode(list(prompts))
            except Exception as exc:  # announced to every rank below: symmetric failure
                error = _describe(exc)
        if self.world_size == 1:
            if error is not None:
                raise RunnerError(f"text encoder failed on rank {self.src_rank}: {error}")
            return [{k: None if v is None else v.to(self.device) for k, v in e.items()} for e in encodings or []]
        return broadcast_encodings(encodings, error, src=self.src_rank, group=self.group, device=self.device)

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str:
        """Collective: the source rank rewrites the prompt (sampling), every rank gets the same string."""
        text, error = None, None
        if self.encoder is not None:
            try:
                text = self.encoder.enhance(prompt, image=image, seed=seed)
            except Exception as exc:
                error = _describe(exc)
        if self.world_size == 1:
            if error is not None:
                raise RunnerError(f"prompt enhancement failed on rank {self.src_rank}: {error}")
            return str(text)
        return _broadcast_text(text, error, src=self.src_rank, group=self.group)


class BatchParallelPromptEncoder:
    """Every rank holds an encoder; prompt `i` is encoded by rank `i % world_size` and broadcast from it.

    Pays a full encoder replica per rank to encode several prompts concurrently; with one prompt it is
    no faster than `DistributedPromptEncoder`. Prompt enhancement runs on rank 0.
    """

    def __init__(
        self, encoder: LocalPromptEncoder, *, group: dist.ProcessGroup | None, device: torch.device | str
    ) -> None:
        self.encoder = encoder
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)

    def encode(self, prompts: Sequence[str]) -> list[Encoding]:
        prompts = list(prompts)
        mine = [i for i in range(len(prompts)) if i % self.world_size == self.rank]
        local: dict[int, Encoding] = {}
        error = None
        try:
            if mine:
                local = dict(zip(mine, self.encoder.encode([prompts[i] for i in mine]), strict=True))
        except Exception as exc:
            error = _describe(exc)
        # Agree on failure first (one small all-reduce), so no rank waits for a broadcast that won't come.
        if self.world_size > 1:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self.group)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                rank, msg = failed[0]
                raise RunnerError(f"text encoder failed on rank {rank}: {msg}")
        elif error is not None:
            raise RunnerError(f"text encoder failed on rank 0: {error}")
        out: list[Encoding] = []
        for i in range(len(prompts)):
            owner = i % self.world_size
            if self.world_size == 1:
                out.append({k: None if v is None else v.to(self.device) for k, v in local[i].items()})
                continue
            got = broadcast_encodings(
                [local[i]] if owner == self.rank else None, None, src=owner, group=self.group, device=self.device
            )
            out.append(got[0])
        return out

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str:
        text, error = None, None
        if self.rank == 0:
            try:
                text = self.encoder.enhance(prompt, image=image, seed=seed)
            except Exception as exc:
                error = _describe(exc)
        if self.world_size == 1:
            if error is not None:
                raise RunnerError(f"prompt enhancement failed on rank 0: {error}")
            return str(text)
        return _broadcast_text(text, error, src=0, group=self.group)
