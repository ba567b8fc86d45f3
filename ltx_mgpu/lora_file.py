"""A user's LoRA file checked from its safetensors header, before any tensor is read or any weight touched.

Why here and without torch: the worker checks a requested LoRA before it hands the path to a fleet (a bad
file must end the job as a request error, never reach the ranks' weights), and the worker side must not
import torch. A safetensors file is an 8-byte little-endian header length, a JSON header and a flat data
buffer, so every check below reads at most `max_header_bytes + 8` bytes of the file, whatever its size.

What a file must be (each failure raises `LoraFileError` naming the file and what is wrong):
- safetensors: a pickle or a zip (`torch.save`) is refused by its first bytes, never parsed;
- within limits: file size, header size, rank (`LoraLimits`);
- consistent: every tensor's byte range matches its dtype and shape, the ranges tile the data buffer with
  no gap or overlap, and the buffer ends exactly at the end of the file (a truncated file is refused);
- a LoRA of this transformer, in the naming ltx-core fuses (`[diffusion_model.]<weight>.lora_A.weight`
  shaped (rank, in) and `.lora_B.weight` shaped (out, rank), `LTXV_LORA_COMFY_RENAMING_MAP`): every key
  names a 2-D weight of the target model, both factors present, shapes matching that weight. ltx-core
  silently skips keys it cannot map; here they are refused, so a LoRA made for another model never
  renders as "no effect".

The targets (`transformer_targets`) are read the same way from the transformer checkpoint's header.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from ltx_mgpu.errors import LtxMgpuError

__all__ = [
    "MAX_HEADER_DEPTH",
    "LoraFile",
    "LoraFileError",
    "LoraLimits",
    "check_header",
    "check_lora",
    "header_length",
    "parse_header",
    "read_header",
    "transformer_targets",
]

#: bytes per element of the safetensors dtypes a LoRA factor may have (what ltx-core's fusion multiplies)
LORA_DTYPES: Mapping[str, int] = {"F16": 2, "BF16": 2, "F32": 4}
#: every safetensors dtype, for checking byte ranges of a checkpoint's header
_ALL_DTYPES: Mapping[str, int] = {
    **LORA_DTYPES,
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_LORA_PREFIX = "diffusion_model."  #: what LTXV_LORA_COMFY_RENAMING_MAP strips
_MODEL_PREFIX = "model.diffusion_model."  #: the transformer's keys in an LTX-2 checkpoint
#: under the transformer's prefix in the checkpoint, but loaded by the text encoder's embeddings processor
#: (ltx-core EMBEDDINGS_PROCESSOR_KEY_OPS): no transformer LoRA can change them
_TEXT_CONNECTORS = ("embeddings_connector.", "video_embeddings_connector.", "audio_embeddings_connector.")


class LoraFileError(LtxMgpuError, ValueError):
    """The file is not a LoRA this service will fuse; the message says what is wrong with it."""


@dataclass(frozen=True)
class LoraLimits:
    """What a LoRA file may be (worker settings `lora_max_file_bytes`, `lora_max_header_bytes`, `lora_max_rank`)."""

    max_file_bytes: int = 4 << 30
    max_header_bytes: int = 16 << 20
    max_rank: int = 256
    dtypes: frozenset[str] = field(default_factory=lambda: frozenset(LORA_DTYPES))


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA: which model weights it changes and with what rank."""

    path: str
    file_bytes: int
    ranks: Mapping[str, int]  #: model weight key ("transformer_blocks.0.attn1.to_q.weight") -> rank

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values(), default=0)


def read_header(path: str | os.PathLike[str], *, max_file_bytes: int, max_header_bytes: int) -> dict:
    """The parsed JSON header of a safetensors file, its byte ranges checked against the file's size.

    Reads the first 8 + header bytes only. Raises `LoraFileError` for anything that is not a well-formed
    safetensors file within the two limits."""
    name = os.fspath(path)
    try:
        size = os.stat(name).st_size
    except OSError as exc:
        raise LoraFileError(f"{name}: cannot read ({exc.strerror or exc})") from None
    with open(name, "rb") as f:
        length = header_length(name, f.read(8), size, max_file_bytes=max_file_bytes, max_header_bytes=max_header_bytes)
        raw = f.read(length)
    return parse_header(name, raw, size)


def header_length(name: str, head: bytes, size: int, *, max_file_bytes: int, max_header_bytes: int) -> int:
    """The header length a safetensors file of `size` bytes declares in its first 8 bytes `head`, checked
    against the limits and the size (`LoraFileError` otherwise): how many bytes to read next, and no more."""
    if size > max_file_bytes:
        raise LoraFileError(f"{name}: file is {size} bytes, over the {max_file_bytes} byte limit")
    _refuse_other_formats(name, head)
    if len(head) < 8 or size < 8:
        raise LoraFileError(f"{name}: {size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", head[:8])
    if length > max_header_bytes:
        raise LoraFileError(f"{name}: header of {length} bytes, over the {max_header_bytes} byte limit")
    if 8 + length > size:
        raise LoraFileError(f"{name}: truncated (header of {length} bytes, file of {size})")
    return length


def parse_header(name: str, raw: bytes, size: int) -> dict:
    """The JSON header `raw` (the `header_length` bytes after the first 8) of a file of `size` bytes, its
    nesting bounded before it is parsed (`MAX_HEADER_DEPTH`) and its byte ranges checked (`LoraFileError`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LoraFileError(f"{name}: header is not JSON ({exc})") from None
    _check_depth(name, text)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (RecursionError: a belt to the depth check's braces)
        raise LoraFileError(f"{name}: header is not JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise LoraFileError(f"{name}: header is not a JSON object")
    _check_ranges(name, header, size - 8 - len(raw))
    return header


#: How deep a safetensors header may nest: {tensor: {"shape": [..]}} is 3; a parser recursing on a header
#: 200,000 levels deep ended the job as `internal` (RecursionError) before this bound.
MAX_HEADER_DEPTH = 8
_INNERMOST = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")


def _check_depth(name: str, text: str) -> None:
    """`LoraFileError` if `text` nests arrays/objects deeper than `MAX_HEADER_DEPTH`, checked in linear time
    without recursion: escapes and strings blanked (`str.replace`, `str.split`), then the innermost containers
    removed once per level (regex passes). Text that is not JSON may pass here; `json.loads` refuses it."""
    if text.count("[") + text.count("{") <= MAX_HEADER_DEPTH:
        return
    unescaped = text.replace("\\\\", "__").replace('\\"', "__")  # (escapes pair left to right, as JSON reads them)
    bare = '""'.join(unescaped.split('"')[::2])  # (outside strings: every other piece between quotes)
    for _ in range(MAX_HEADER_DEPTH):
        bare, n = _INNERMOST.subn("0", bare)
        if n == 0:
            break
    if "[" in bare or "{" in bare:
        raise LoraFileError(f"{name}: header nests deeper than {MAX_HEADER_DEPTH} levels")


def _refuse_other_formats(name: str, head: bytes) -> None:
    if head.startswith(b"PK\x03\x04"):
        raise LoraFileError(f"{name}: a zip archive (torch.save format), not safetensors; only safetensors is loaded")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise LoraFileError(f"{name}: a Python pickle, not safetensors; pickles are never loaded")


def _check_ranges(name: str, header: dict, buffer_bytes: int) -> None:
    """Each tensor's [begin, end) holds exactly its dtype x shape, and the ranges tile the buffer."""
    ranges = []
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise LoraFileError(f"{name}: __metadata__ must map strings to strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise LoraFileError(f"{name}: tensor {key!r} has a malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ALL_DTYPES:
            raise LoraFileError(f"{name}: tensor {key!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise LoraFileError(f"{name}: tensor {key!r} has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise LoraFileError(f"{name}: tensor {key!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * _ALL_DTYPES[dtype]:
            raise LoraFileError(f"{name}: tensor {key!r}: data_offsets {offsets} do not hold {dtype} x {shape}")
        ranges.append((begin, end, key))
    position = 0
    for begin, end, key in sorted(ranges):
        if begin != position:
            raise LoraFileError(f"{name}: tensor {key!r} starts at {begin}, expected {position} (gap or overlap)")
        position = end
    if position > buffer_bytes:
        raise LoraFileError(f"{name}: truncated (header describes {position} data bytes, file holds {buffer_bytes})")
    if position != buffer_bytes:
        raise LoraFileError(f"{name}: {buffer_bytes - position} bytes after the last tensor")


def transformer_targets(
    checkpoint_path: str | os.PathLike[str], *, max_header_bytes: int = 256 << 20
) -> dict[str, tuple[int, int]]:
    """The LoRA-able weights of an LTX-2 checkpoint's transformer: model key -> (out_features, in_features).

    2-D floating `*.weight` tensors under `model.diffusion_model.` but for the text connectors, named as the
    model names them (the prefix stripped, as `LTXV_MODEL_COMFY_RENAMING_MAP` does): the keys
    `LoraWeightTracker` tracks."""
    header = read_header(checkpoint_path, max_file_bytes=1 << 62, max_header_bytes=max_header_bytes)
    return {
        key[len(_MODEL_PREFIX) :]: (entry["shape"][0], entry["shape"][1])
        for key, entry in header.items()
        if key.startswith(_MODEL_PREFIX)
        and not key[len(_MODEL_PREFIX) :].startswith(_TEXT_CONNECTORS)
        and key.endswith(".weight")
        and isinstance(entry, dict)
        and entry.get("dtype") in _FLOAT_DTYPES
        and len(entry.get("shape", ())) == 2
    }


def check_lora(
    path: str | os.PathLike[str], targets: Mapping[str, tuple[int, int]], limits: LoraLimits | None = None
) -> LoraFile:
    """Check `path` as a LoRA of the model whose LoRA-able weights are `targets` (see the module docstring)."""
    limits = limits or LoraLimits()
    name = os.fspath(path)
    header = read_header(name, max_file_bytes=limits.max_file_bytes, max_header_bytes=limits.max_header_bytes)
    return check_header(name, header, os.stat(name).st_size, targets, limits)


def check_header(
    name: str, header: dict, size: int, targets: Mapping[str, tuple[int, int]], limits: LoraLimits | None = None
) -> LoraFile:
    """The LoRA checks of `check_lora` on a parsed header (`parse_header`) of a file of `size` bytes: what a
    remote object is checked with from its first bytes, before its body is fetched."""
    limits = limits or LoraLimits()
    factors: dict[str, dict[str, list[int]]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoraFileError(
                f"{name}: key {key!r} is not a LoRA factor (expected '<weight>.lora_A.weight' / '.lora_B.weight', "
                "the naming ltx-core fuses)"
            )
        if entry["dtype"] not in limits.dtypes:
            raise LoraFileError(f"{name}: tensor {key!r} is {entry['dtype']}; allowed: {sorted(limits.dtypes)}")
        bare = key.replace(_LORA_PREFIX, "")
        target = bare[: -len(suffix)] + ".weight"
        if target not in targets:
            raise LoraFileError(f"{name}: key {key!r} names {target!r}, which is not a LoRA-able transformer weight")
        factors.setdefault(target, {})[suffix] = entry["shape"]
    if not factors:
        raise LoraFileError(f"{name}: holds no LoRA factors")
    ranks: dict[str, int] = {}
    for target, pair in sorted(factors.items()):
        ranks[target] = _rank(name, target, pair, targets[target], limits.max_rank)
    return LoraFile(name, size, ranks)


def _rank(name: str, target: str, pair: dict[str, list[int]], shape: tuple[int, int], max_rank: int) -> int:
    """(rank, in) and (out, rank) against the weight's (out, in)."""
    a, b = pair.get(_LORA_SUFFIXES[0]), pair.get(_LORA_SUFFIXES[1])
    if a is None or b is None:
        missing = "lora_A" if a is None else "lora_B"
        raise LoraFileError(f"{name}: {target!r} has no {missing} factor")
    out_features, in_features = shape
    if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or a[0] != b[1]:
        raise LoraFileError(
            f"{name}: {target!r} is {out_features}x{in_features}; lora_A {a} and lora_B {b} do not fit it "
            f"(expected [rank, {in_features}] and [{out_features}, rank])"
        )
    if not 1 <= a[0] <= max_rank:
        raise LoraFileError(f"{name}: {target!r} has rank {a[0]}; allowed 1..{max_rank}")
    return a[0]
