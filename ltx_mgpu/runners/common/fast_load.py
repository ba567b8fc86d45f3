"""Safetensors straight to the GPU through pinned staging buffers: the weight-load phase of a cold start.

ltx-core's loader (`SafetensorsStateDictLoader`) opens each file with `safe_open(..., device="cuda:N")` and
copies tensor by tensor from the memory-mapped file: every copy is a synchronous transfer from pageable
memory, page faults included. Measured on an H200 host with the 19B checkpoint in /dev/shm, a rank's
weight load ran at about 1.4-3.4 GB/s and took 25-31 s of a 46-56 s cold start.

`StagedSafetensorsLoader` is a drop-in `StateDictLoader` (the same `load(path, sd_ops, device)` contract and
the same key selection and key/value ops) that reads the selected byte ranges of a file with `os.preadv`
from reader threads (the GIL is released while they read) into a ring of pinned buffers and copies each
filled buffer to the device on a side stream while the next ones are read. All tensors of one file land in
one device allocation, packed in file order, each starting at a 256-byte boundary; the state dict holds
views of it (a model built with `assign=True` keeps them as its parameters). CPU destinations use
ltx-core's loader unchanged: there is nothing to stage.

Key-value ops that replace tensors (a quantization casting each weight at load) change that: the file is read
in groups of at most `group_bytes`, each group's ops run as soon as it has landed, and its originals are
dropped before the next group is read. Read whole, the 19B transformer's 36.5 GiB of bf16 sat on the device
beside its growing fp8 copy until the last weight was cast: an fp8 fleet capped at 40 GiB (a 48 GB card's
share) ran out of memory at 39.7 GiB in the middle of its setup, for a transformer that holds 20.1 GiB once
loaded. One ring of staging buffers serves every group of a file.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StagedSafetensorsLoader", "read_header", "staged_model_loader"]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_ALIGN = 256  #: every tensor starts at a multiple of this many bytes in the device allocation
_MAX_HEADER = 100 << 20  #: a header larger than this is not a safetensors file we wrote or read


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  #: absolute file offset of the first byte
    nbytes: int


def read_header(path: str) -> tuple[list[_Entry], dict[str, str]]:
    """The tensors of a safetensors file (in file order, absolute offsets) and its metadata."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    base = 8 + size
    metadata = header.pop("__metadata__", None) or {}
    entries = []
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = (int(x) for x in info["data_offsets"])
        entries.append(
            _Entry(name, _DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]), base + begin, end - begin)
        )
    entries.sort(key=lambda e: e.begin)
    return entries, metadata


def _segments(entries: list[_Entry], offsets: list[int]) -> Iterator[tuple[int, int, int]]:
    """(file offset, device offset, bytes) runs, merging tensors adjacent both in the file and on the device."""
    run: list[int] | None = None
    for entry, dest in zip(entries, offsets, strict=True):
        if entry.nbytes == 0:
            continue
        if run is not None and run[0] + run[2] == entry.begin and run[1] + run[2] == dest:
            run[2] += entry.nbytes
            continue
        if run is not None:
            yield run[0], run[1], run[2]
        run = [entry.begin, dest, entry.nbytes]
    if run is not None:
        yield run[0], run[1], run[2]


def _may_replace(sd_ops: Any) -> bool:
    """Whether `sd_ops` has key-value ops, which may put new tensors in place of the file's (ltx-core's
    `SDOps` says so in its mapping; ops of another shape are assumed to)."""
    if sd_ops is None:
        return False
    mapping = getattr(sd_ops, "mapping", None)
    if mapping is None:
        return True
    return any(hasattr(op, "kv_operation") for op in mapping)


def _groups(chosen: list[tuple[_Entry, str]], limit: int) -> list[list[tuple[_Entry, str]]]:
    """`chosen` (file order) cut into runs of at most `limit` bytes; a tensor larger than `limit` is a run alone."""
    groups: list[list[tuple[_Entry, str]]] = []
    size = 0
    for item in chosen:
        if not groups or (size + item[0].nbytes > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[0].nbytes
    return groups


def _apply_value_ops(
    group: list[tuple[_Entry, str]], values: list[torch.Tensor], sd_ops: Any
) -> list[tuple[str, torch.Tensor]]:
    """The group's (key, tensor) pairs after `sd_ops`' key-value ops. Where the ops replaced some tensors (e.g.
    a quantization casting weights), the few views left would keep the group's whole allocation alive beside the
    replacements, so they get storage of their own."""
    out: list[tuple[str, torch.Tensor]] = []
    for (_, key), value in zip(group, values, strict=True):
        out.extend(((key, value),) if sd_ops is None else sd_ops.apply_to_key_value(key, value))
    if not values:
        return out
    base = values[0].untyped_storage().data_ptr()
    views = [v.untyped_storage().data_ptr() == base for _, v in out]
    if all(views):
        return out
    clones: dict[int, torch.Tensor] = {}  # (a tensor an op filed under two keys stays one tensor)
    for (_, value), is_view in zip(out, views, strict=True):
        if is_view and id(value) not in clones:
            clones[id(value)] = value.clone()
    return [(k, clones.get(id(v), v)) for k, v in out]


class StagedSafetensorsLoader:
    """A `StateDictLoader` (ltx-core's protocol) that stages file reads through pinned memory; see the module
    docstring. `chunk_bytes` x `buffers` of pinned host memory are held only while a file loads."""

    def __init__(
        self,
        *,
        chunk_bytes: int = 64 << 20,
        buffers: int = 6,
        readers: int = 4,
        group_bytes: int = 2 << 30,
        stage_cpu: bool = False,
    ) -> None:
        if chunk_bytes <= 0 or buffers < 2 or readers < 1 or group_bytes <= 0:
            raise ValueError("need chunk_bytes > 0, buffers >= 2, readers >= 1 and group_bytes > 0")
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.readers = min(readers, buffers)
        #: with key-value ops, the most bytes of originals on the device at once (a larger tensor: alone). 2 GiB
        #: sits inside the memory plan's 4 GiB headroom with the largest weight's fp32 copy (0.25 GiB) that a
        #: quantization makes; each group ends in a short pipeline drain (~one chunk), 18 of them in 36.5 GiB
        self.group_bytes = group_bytes
        self.stage_cpu = stage_cpu  #: stage CPU destinations too (tests: the same path without a GPU)

    def metadata(self, path: str) -> dict:  # (the config entry, as ltx-core's model loader reads it)
        meta = read_header(path)[1]
        return json.loads(meta["config"]) if "config" in meta else {}

    def load(self, path: str | list[str], sd_ops: Any = None, device: torch.device | None = None) -> Any:
        from ltx_core.loader.primitives import StateDict

        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type != "cuda" and not self.stage_cpu:
            from ltx_core.loader.sft_loader import SafetensorsStateDictLoader

            return SafetensorsStateDictLoader().load(path, sd_ops, device)
        sd: dict[str, torch.Tensor] = {}
        size, dtypes = 0, set()
        for shard in path if isinstance(path, list) else [path]:
            for key, value in self._load_file(shard, sd_ops, device):
                sd[key] = value
                size += value.nbytes
                dtypes.add(value.dtype)
        return StateDict(sd=sd, device=device, size=size, dtype=dtypes)

    def read_tensors(self, path: str, names: Sequence[str], device: torch.device | str) -> dict[str, torch.Tensor]:
        """The tensors `names` of one file (their names in the file, no key ops) on `device`, as views of one
        allocation. Tensors that follow each other in the file stay adjacent there, so their bytes travel in
        `chunk_bytes` pieces rather than one small copy per tensor: what a request LoRA's thousands of
        ~1 MB factors need (`LoraWeightTracker(factor_reader=...)`). A name the file lacks: `KeyError`."""
        device = torch.device(device)
        wanted = set(names)
        entries = [e for e in read_header(path)[0] if e.name in wanted]
        if len(entries) != len(wanted):
            missing = sorted(wanted - {e.name for e in entries})
            raise KeyError(f"{path}: no tensor named {missing[:5]} ({len(missing)} missing)")
        if device.type != "cuda" and not self.stage_cpu:
            from safetensors import safe_open

            with safe_open(path, framework="pt", device=str(device)) as f:
                return {name: f.get_tensor(name) for name in names}
        values = self._read_entries(path, entries, device, keep_runs=True)
        return {e.name: v for e, v in zip(entries, values, strict=True)}

    # ---- one file ------------------------------------------------------------------------------------
    def _load_file(self, path: str, sd_ops: Any, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """The (key, tensor) pairs of one file after the key ops: views of one device allocation, or, where the
        ops may replace tensors, of one allocation per group (see the module docstring)."""
        entries, _ = read_header(path)
        chosen: list[tuple[_Entry, str]] = []
        for entry in entries:
            key = entry.name if sd_ops is None else sd_ops.apply_to_key(entry.name)
            if key is not None:
                chosen.append((entry, key))
        groups = _groups(chosen, self.group_bytes) if _may_replace(sd_ops) else [chosen]
        staging = None
        if len(groups) > 1:  # (one ring for every group: page-locking it again per group would cost ~0.2 s each)
            chunks = sum(-(-e.nbytes // self.chunk_bytes) for e, _ in chosen)
            staging = self._staging(min(self.buffers, chunks), device.type == "cuda")
        out: list[tuple[str, torch.Tensor]] = []
        for group in groups:
            values = self._read_entries(path, [e for e, _ in group], device, keep_runs=False, staging=staging)
            out.extend(_apply_value_ops(group, values, sd_ops))
            del values  # (the group's originals: only what the ops kept still refers to them)
        return iter(out)

    def _read_entries(
        self,
        path: str,
        entries: list[_Entry],
        device: torch.device,
        *,
        keep_runs: bool,
        staging: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """`entries` (in file order) read into one `device` allocation, as views. Each starts at a multiple of
        `_ALIGN` bytes, except, with `keep_runs`, one that follows its predecessor in the file at a 16-byte
        boundary: it stays adjacent, so a run of small tensors travels as one piece."""
        offsets, end, previous = [], 0, None
        for entry in entries:
            adjacent = keep_runs and previous is not None and previous.begin + previous.nbytes == entry.begin
            if not (adjacent and end % 16 == 0):
                end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += entry.nbytes
            previous = entry
        flat = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        self._copy(path, list(_segments(entries, offsets)), flat, staging)
        return [flat[o : o + e.nbytes].view(e.dtype).view(e.shape) for e, o in zip(entries, offsets, strict=True)]

    def _staging(self, count: int, pinned: bool) -> list[torch.Tensor]:
        """A ring of `count` staging buffers of `chunk_bytes` (page-locked for a CUDA destination)."""
        return [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)]

    def _copy(
        self,
        path: str,
        segments: list[tuple[int, int, int]],
        flat: torch.Tensor,
        staging: list[torch.Tensor] | None = None,
    ) -> None:
        """Read every segment's bytes into `flat`. Reader threads fill a ring of staging buffers (`staging`,
        else one of its own); this thread sends the chunks on in file order. Chunk k uses buffer k % n, taken
        in chunk order (a turnstile), so a reader only ever waits for chunk k - n, which this thread has already
        sent: no deadlock. Every copy out of the ring has finished when it returns."""
        chunks = [
            (src + i, dst + i, min(self.chunk_bytes, n - i))
            for src, dst, n in segments
            for i in range(0, n, self.chunk_bytes)
        ]
        if not chunks:
            return
        cuda = flat.device.type == "cuda"
        if staging is None:
            staging = self._staging(min(self.buffers, len(chunks)), cuda)
        nbuf = min(len(staging), len(chunks))
        views = [memoryview(b.numpy()) for b in staging]
        slot_free = [threading.Semaphore(1) for _ in range(nbuf)]
        turn, next_turn = threading.Condition(), [0]
        filled: dict[int, int | BaseException] = {}
        ready = threading.Condition()
        tasks: queue.Queue[int | None] = queue.Queue()
        stop = threading.Event()
        fd = os.open(path, os.O_RDONLY)

        def reader() -> None:
            while (index := tasks.get()) is not None:
                with turn:
                    while next_turn[0] != index and not stop.is_set():
                        turn.wait()
                slot_free[index % nbuf].acquire()
                with turn:
                    next_turn[0] += 1
                    turn.notify_all()
                if stop.is_set():
                    return
                src, _, n = chunks[index]
                try:
                    got = os.preadv(fd, [views[index % nbuf][:n]], src)
                    result: int | BaseException = n if got == n else OSError(f"{path}: short read at {src}")
                except BaseException as exc:  # handed to the sending thread, which raises it
                    result = exc
                with ready:
                    filled[index] = result
                    ready.notify_all()

        threads = [threading.Thread(target=reader, daemon=True, name=f"fast_load-{i}") for i in range(self.readers)]
        for index in range(len(chunks)):
            tasks.put(index)
        for t in threads:
            tasks.put(None)
            t.start()
        stream = torch.cuda.Stream(device=flat.device) if cuda else None
        if stream is not None:
            # `flat` may reuse memory that work queued on the current stream still reads (the previous group's
            # conversion, freed by the caching allocator as soon as it was queued): the copies wait for that work
            stream.wait_stream(torch.cuda.current_stream(flat.device))
        pending: list[tuple[Any, int]] = []  # (copy-done event, buffer) in chunk order

        def release(upto: int) -> None:  # wait for the oldest copies and hand their buffers back
            while len(pending) > upto:
                event, used = pending.pop(0)
                event.synchronize()
                slot_free[used].release()

        try:
            for index in range(len(chunks)):
                with ready:
                    waiting = index not in filled
                if waiting:
                    release(0)  # (its reader may be waiting for a buffer still in flight)
                    with ready:
                        while index not in filled:
                            ready.wait()
                with ready:
                    result = filled.pop(index)
                if isinstance(result, BaseException):
                    raise result
                slot, dst = index % nbuf, chunks[index][1]
                if stream is None:
                    flat[dst : dst + result].copy_(staging[slot][:result])
                    slot_free[slot].release()
                    continue
                with torch.cuda.stream(stream):
                    flat[dst : dst + result].copy_(staging[slot][:result], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                pending.append((done, slot))
                while pending and pending[0][0].query():
                    release(len(pending) - 1)
            release(0)
        finally:
            stop.set()
            with turn:
                turn.notify_all()
            release(0)
            for sem in slot_free:  # wake readers still waiting for a buffer (after an error)
                for _ in threads:
                    sem.release()
            for t in threads:
                t.join(timeout=30)
            os.close(fd)
        if stream is not None:
            torch.cuda.current_stream(flat.device).wait_stream(stream)


def staged_model_loader() -> Any:
    """ltx-core's model loader (config from the file's metadata) reading weights with the staged loader."""
    from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader

    return SafetensorsModelStateDictLoader(weight_loader=StagedSafetensorsLoader())
