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

from ...control.errors import RunnerError
from ..sharding.collectives import needs_host_staging

__all__ = [
    "BatchParallelPromptEncoder",
    "DistributedPromptEncoder",
    "EncodingCache",
    "LocalPromptEncoder",
    "broadcast_encodings",
]

Encoding = dict[str, torch.Tensor | None]


class LocalPromptEncoder(Protocol):
    """What a rank-local encoder provides."""

    def encode(self, prompts: Sequence[str]) -> list[Encoding]: ...

    # optional: `identity` (str), what the outputs depend on; without it nothing is cached

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str: ...


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)}


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


_ALIGN = 64  #: byte alignment of each tensor in the packed wire buffer (any dtype's view stays aligned)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def broadcast_encodings(
    encodings: list[Encoding] | None,
    error: str | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    extra: dict[str, Any] | None = None,
    _meta_out: list[Any] | None = None,
) -> list[Encoding]:
    """Collective: rank `src` (group rank) sends `encodings` (or an `error`), every rank returns them on
    `device`. Two collectives whatever the count: the metadata (names, shapes, dtypes, byte offsets, or the
    error, plus `extra` from the source) as one object broadcast, then every tensor packed into one byte
    buffer as one tensor broadcast (each broadcast is a rendezvous of the group: one per tensor would make
    the cost grow with their count). `_meta_out`, if given, receives the metadata (its `extra`) on every rank."""
    me = dist.get_rank(group)
    header: list[Any] = [None]
    if me == src:
        if error is not None:
            header[0] = {"error": error, "extra": extra}
        else:
            assert encodings is not None
            items, offset = [], 0
            for enc in encodings:
                item: dict[str, Any] = {}
                for k, v in enc.items():
                    if v is None:
                        item[k] = None
                        continue
                    nbytes = v.numel() * v.element_size()
                    item[k] = (tuple(v.shape), str(v.dtype), offset, nbytes)
                    offset += _aligned(nbytes)
                items.append(item)
            header[0] = {"items": items, "bytes": offset, "extra": extra}
    dist.broadcast_object_list(header, src=_global(group, src), group=group)
    meta = header[0]
    if _meta_out is not None:
        _meta_out.append(meta.get("extra"))
    if "error" in meta:
        raise RunnerError(f"text encoder failed on rank {src}: {meta['error']}")
    staged = needs_host_staging(group, device)
    wire_device = torch.device("cpu") if staged else device
    wire = torch.empty(int(meta["bytes"]), dtype=torch.uint8, device=wire_device)
    if me == src:
        assert encodings is not None
        for enc, item in zip(encodings, meta["items"], strict=True):
            for name, spec in item.items():
                if spec is not None:
                    value = enc[name]
                    assert value is not None
                    _, _, offset, nbytes = spec
                    raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
                    wire[offset : offset + nbytes].copy_(raw)
    if wire.numel():
        dist.broadcast(wire, src=_global(group, src), group=group)
    if staged:
        wire = wire.to(device)
    out: list[Encoding] = []
    for item in meta["items"]:
        enc: Encoding = {}
        for name, spec in item.items():
            if spec is None:
                enc[name] = None
                continue
            shape, dtype, offset, nbytes = spec
            enc[name] = wire[offset : offset + nbytes].view(_DTYPES[dtype]).view(shape)
        out.append(enc)
    return out


class EncodingCache:
    """Per-rank embeddings of prompts that repeat (the constant default negative prompt), keyed by the prompt
    text under one encoder identity: a different identity (another encoder, changed weights) empties it.

    Every rank of a `DistributedPromptEncoder` makes the same calls in the same order (the source rank's
    decisions travel in the metadata), so the caches of all ranks hold the same keys. Bounded: least
    recently used entries go first."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = int(capacity)
        self.identity: str | None = None
        self._entries: dict[str, Encoding] = {}
        self.hits = 0
        self.misses = 0

    def bind(self, identity: str | None) -> None:
        """Use `identity`'s entries from now on (dropping everything if it changed)."""
        if identity != self.identity:
            self._entries.clear()
            self.identity = identity

    def get(self, text: str) -> Encoding | None:
        enc = self._entries.pop(text, None)
        if enc is not None:
            self._entries[text] = enc  # most recent last
        return enc

    def __contains__(self, text: str) -> bool:
        return text in self._entries

    def put(self, text: str, enc: Encoding) -> None:
        if self.identity is None or self.capacity <= 0:
            return  # an encoder without an identity cannot be told apart from its replacement: no caching
        # own storage: a view into the packed wire buffer would keep the whole buffer alive
        self._entries[text] = {k: None if v is None else v.clone() for k, v in enc.items()}
        while len(self._entries) > self.capacity:
            self._entries.pop(next(iter(self._entries)))


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
        self.cache = EncodingCache()

    def encode(self, prompts: Sequence[str], *, cacheable: Sequence[bool] = ()) -> list[Encoding]:
        """Collective: one encoding per prompt, identical on every rank. Prompts flagged in `cacheable` (e.g.
        the default negative prompt) are taken from every rank's `cache` when there; the source rank decides
        and the others follow its decision, so nothing but the missing prompts is encoded or sent."""
        prompts = list(prompts)
        flags = [bool(f) for f in cacheable] + [False] * (len(prompts) - len(cacheable))
        encodings, error, hits = None, None, []
        if self.encoder is not None:
            self.cache.bind(getattr(self.encoder, "identity", None))
            hits = [i for i, p in enumerate(prompts) if flags[i] and p in self.cache]
            todo = [p for i, p in enumerate(prompts) if i not in hits]
            try:
                encodings = self.encoder.encode(todo) if todo else []
            except Exception as exc:  # announced to every rank below: symmetric failure
                error = _describe(exc)
        if self.world_size == 1:
            if error is not None:
                raise RunnerError(f"text encoder failed on rank {self.src_rank}: {error}")
            fresh = [{k: None if v is None else v.to(self.device) for k, v in e.items()} for e in encodings or []]
            return self._merge(prompts, flags, hits, fresh)
        meta: list[Any] = []
        extra = {"identity": self.cache.identity, "hits": hits}
        fresh = broadcast_encodings(
            encodings, error, src=self.src_rank, group=self.group, device=self.device, extra=extra, _meta_out=meta
        )
        if self.encoder is None:
            self.cache.bind(meta[0]["identity"])
            hits = list(meta[0]["hits"])
        return self._merge(prompts, flags, hits, fresh)

    def _merge(self, prompts: list[str], flags: list[bool], hits: list[int], fresh: list[Encoding]) -> list[Encoding]:
        """The cached encodings at `hits` and the `fresh` ones elsewhere, in prompt order; caches the fresh
        cacheable ones (every rank alike)."""
        out: list[Encoding] = []
        new = iter(fresh)
        for i, prompt in enumerate(prompts):
            if i in hits:
                enc = self.cache.get(prompt)
                if enc is None:  # the source's cache and ours disagree: a bug, not a request error
                    raise RuntimeError(f"prompt cache out of step with rank {self.src_rank} for prompt {i}")
                self.cache.hits += 1
            else:
                enc = next(new)
                if flags[i]:
                    self.cache.misses += 1
                    self.cache.put(prompt, enc)
            out.append(enc)
        return out

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

    def encode(self, prompts: Sequence[str], *, cacheable: Sequence[bool] = ()) -> list[Encoding]:
        del cacheable  # every rank holds an encoder and encodes its share at once: nothing to save by caching
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
