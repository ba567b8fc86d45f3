"""Seeded random weights in real checkpoint layouts, written as safetensors without holding them in memory.

No LTX-2 weights can be downloaded here, so test and benchmark checkpoints are the real architectures with
seeded random weights. A checkpoint is first a *plan*: one `TensorSpec` (file key, shape, dtype, how to
fill it) per tensor, read off a model built on the meta device (`module_specs`), so the plan costs no
memory at any size. `write_safetensors` then streams the plan into a file: it writes the safetensors header
(every key's dtype, shape and offsets are known from the plan) and then each tensor's bytes as it is
generated, on the device given (CUDA on a GPU host: generation is then ~free and the disk is the limit),
through two reused staging buffers and a writer thread. Host memory stays at two chunks whatever the file
size; the file appears under its final name only when complete (temporary name, then rename).

Fill rules (activations stay finite through deep stacks in bfloat16): weights and other >= 2-D tensors
~ N(0, 1/fan_in) with fan_in = the size of one output row; norm scales at 1 (0 for Gemma-style norms that
scale by 1 + w); biases and norm shifts 0; per-channel latent statistics the identity (mean 0, std 1).
Each tensor's generator is seeded from the seed and its key, so any subset of a checkpoint (or a rerun)
has the same bytes for the same key on the same device type.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TensorSpec",
    "atomic_path",
    "fill",
    "module_specs",
    "specs_bytes",
    "write_json",
    "write_safetensors",
]

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float8_e4m3fn: "F8_E4M3",
}
_NORM_TYPES = ("LayerNorm", "RMSNorm", "GroupNorm", "Gemma3RMSNorm")
_STAT_ONES = ("std-of-means",)
_STAT_ZEROS = ("mean-of-means",)
CHUNK_BYTES = 256 << 20  #: staging chunk for device -> file copies


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its file key, shape, dtype and fill ("normal" with `std`, "ones", "zeros")."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str = "normal"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


def module_specs(
    module: torch.nn.Module,
    *,
    dtype: torch.dtype,
    rename: Callable[[str], str | None] = lambda key: key,
    zero_centered_norms: Sequence[str] = (),
) -> list[TensorSpec]:
    """The plan of `module`'s state dict (build it on the meta device): file key = `rename(key)` (None drops
    the key), floating tensors in `dtype`. `zero_centered_norms`: norm class names whose weight w scales by
    1 + w (Gemma), filled with 0 so they start at scale 1 too."""
    owners: dict[str, torch.nn.Module] = {}
    for prefix, sub in module.named_modules():
        for name, _ in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            owners[f"{prefix}.{name}" if prefix else name] = sub
    specs = []
    for key, value in module.state_dict(keep_vars=True).items():
        file_key = rename(key)
        if file_key is None:
            continue
        leaf = key.rsplit(".", 1)[-1]
        owner = type(owners.get(key, module)).__name__
        shape = tuple(int(d) for d in value.shape)
        out_dtype = dtype if value.is_floating_point() else value.dtype
        if any(leaf == s for s in _STAT_ONES):
            specs.append(TensorSpec(file_key, shape, out_dtype, "ones"))
        elif any(leaf == s for s in _STAT_ZEROS) or leaf == "bias" or not value.is_floating_point():
            specs.append(TensorSpec(file_key, shape, out_dtype, "zeros"))
        elif owner in _NORM_TYPES and leaf == "weight":
            specs.append(TensorSpec(file_key, shape, out_dtype, "zeros" if owner in zero_centered_norms else "ones"))
        elif len(shape) >= 2:
            fan_in = max(1, value[0].numel())
            specs.append(TensorSpec(file_key, shape, out_dtype, "normal", fan_in**-0.5))
        else:
            specs.append(TensorSpec(file_key, shape, out_dtype, "normal", 0.02))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def fill(spec: TensorSpec, seed: int, device: torch.device | str) -> torch.Tensor:
    """The tensor `spec` describes, generated on `device` (seeded by `seed` and the key)."""
    device = torch.device(device)
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=spec.dtype, device=device)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, spec.name))
    out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    return out.normal_(0.0, spec.std, generator=gen)


# =========================================================================================================
# Files
# =========================================================================================================


def atomic_path(path: Path, write: Callable[[str], None]) -> None:
    """Run `write(tmp)` on a temporary file next to `path`, then rename it into place (readers see no file
    or the whole file; concurrent writers of the same content are safe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; caches are shared by every rank and fleet
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    atomic_path(path, write)


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.name in entries:
            raise ValueError(f"duplicate tensor key {spec.name!r}")
        entries[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class _Stager:
    """Device bytes -> file through two reused host buffers (pinned on CUDA) and one writer thread, so the
    copy of one chunk overlaps the write of the previous one."""

    def __init__(self, out: Any, device: torch.device, chunk_bytes: int) -> None:
        self.out, self.device = out, device
        pin = device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.pending: list[threading.Thread | None] = [None, None]
        self.errors: list[BaseException] = []
        self.turn = 0

    def _write(self, view: Any) -> None:
        try:
            self.out.write(view)
        except BaseException as exc:
            self.errors.append(exc)

    def push(self, flat: torch.Tensor) -> None:
        """Queue the bytes of a contiguous uint8 tensor (any device)."""
        size = self.buffers[0].numel()
        for start in range(0, flat.numel(), size):
            part = flat[start : start + size]
            i = self.turn
            self.turn ^= 1
            self.wait(i)  # this buffer's previous chunk is on disk
            staged = self.buffers[i][: part.numel()]
            staged.copy_(part)  # synchronous device -> host copy, overlapping the previous chunk's write
            self.wait(i ^ 1)  # chunks reach the file in order: one write at a time
            worker = threading.Thread(target=self._write, args=(memoryview(staged.numpy()),), daemon=True)
            worker.start()
            self.pending[i] = worker

    def wait(self, i: int | None = None) -> None:
        for j in [0, 1] if i is None else [i]:
            worker = self.pending[j]
            if worker is not None:
                worker.join()
                self.pending[j] = None
        if self.errors:
            raise self.errors[0]


def write_safetensors(
    path: str | Path,
    specs: Sequence[TensorSpec],
    *,
    seed: int,
    device: torch.device | str = "cpu",
    metadata: dict[str, str] | None = None,
    tensors: Callable[[TensorSpec], torch.Tensor] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Any]:
    """Stream `specs` into the safetensors file `path` (atomically) and return {file, bytes, tensors,
    seconds}. Each tensor is `tensors(spec)` when given (fixed content, e.g. a tokenizer-sized table) or
    `fill(spec, seed, device)`."""
    path, device = Path(path), torch.device(device)
    start = time.perf_counter()
    header = _header(specs, metadata or {})
    total = len(header)

    def write(tmp: str) -> None:
        nonlocal total
        with open(tmp, "wb", buffering=0) as out:
            out.write(header)
            largest = max((s.nbytes for s in specs), default=1)
            stager = _Stager(out, device, max(1, min(chunk_bytes, largest)))
            for spec in specs:
                value = tensors(spec) if tensors is not None else fill(spec, seed, device)
                if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
                    raise ValueError(f"{spec.name}: got {value.dtype} {tuple(value.shape)}, planned {spec}")
                stager.push(value.contiguous().reshape(-1).view(torch.uint8))
                total += spec.nbytes
            stager.wait()

    atomic_path(path, write)
    return {"file": str(path), "bytes": total, "tensors": len(specs), "seconds": round(time.perf_counter() - start, 3)}


def specs_bytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)
