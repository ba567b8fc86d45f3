"""Malformed and hostile render requests, and the three doors they are pushed through.

Requests come from hypothesis strategies (random JSON; a valid request with one field replaced by a
hostile value: huge strings, negative or huge numbers, NaN, wrong types, unknown fields), drawn
reproducibly from a seed, plus a fixed list of classics (deep nesting, 1 MB prompts, non-objects).
Only requests the real `RenderRequest` rejects count as bad inputs; a generated one that happens to be
valid is dropped (it is not hostile, and it could be a slow render).

Doors:
- `cli`: `producer submit FILE` (in-process click runner): must exit non-zero and enqueue nothing;
- `enqueue`: straight into RQ with the JSON serializer, bypassing the producer: the worker must fail the
  job with `invalid_request` and leave its fleet alone;
- `raw`: hand-written `rq:job:<id>` hashes pushed onto the queue list (garbage data, a function other
  than the render function, wrong arguments, missing fields, a hash bigger than any job): no worker may
  die, nothing but the render function may run (a canary directory shows it), and the job must not stay
  queued or started.
"""

from __future__ import annotations

import base64
import json
import math
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from worker.protocol.keys import RENDER_FUNC
from worker.protocol.schema import RenderRequest

__all__ = ["BadInput", "DeepNest", "canary_paths", "generate_bad_inputs", "is_bad", "raw_job_hashes", "to_text"]

VALID = {"prompt": "a calm lake", "width": 64, "height": 64, "num_frames": 9, "steps": 1}
FIELDS = ["prompt", "negative_prompt", "seed", "width", "height", "num_frames", "frame_rate", "steps",
          "guidance_scale", "enhance_prompt", "images"]  # fmt: skip

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)  # fmt: skip
_hostile_value = st.one_of(
    _leaf,
    st.sampled_from(["x" * 100_000, "\x00" * 5000, "🦊" * 5000, "", " ", "-1", "1e309", "NaN"]),
    st.sampled_from([-1, 0, -(2**63), 2**63, 2**64 + 1, 10**30, 31, 33, 2049, 258, 1e-300, -0.0]),
    st.lists(_leaf, max_size=3),
    st.dictionaries(st.text(max_size=5), _leaf, max_size=3),
)


def _mutate(name: str, value: Any) -> dict[str, Any]:
    out = dict(VALID)
    out[name] = value
    return out


_requests = st.one_of(
    _json,
    st.builds(_mutate, st.sampled_from(FIELDS), _hostile_value),
    st.builds(_mutate, st.text(min_size=1, max_size=12).filter(lambda s: s not in FIELDS), _hostile_value),
    st.dictionaries(st.sampled_from(FIELDS), _hostile_value, max_size=5),
)


def _lying_webp() -> str:
    """A WebP whose VP8X canvas (16x16) hides the size its VP8L bitstream declares (16000x16000)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return kind + len(data).to_bytes(4, "little") + data

    vp8l = b"\x2f" + (15999 | 15999 << 14).to_bytes(4, "little") + b"\0" * 8
    body = b"WEBP" + chunk(b"VP8X", b"\0" * 4 + (15).to_bytes(3, "little") * 2) + chunk(b"VP8L", vp8l)
    return base64.b64encode(b"RIFF" + len(body).to_bytes(4, "little") + body).decode()


_LYING_WEBP = _lying_webp()


def _classics() -> list[Any]:
    return [
        {"prompt": "x" * 1_000_000},
        {**VALID, "width": -64},
        {**VALID, "height": 2**64},
        {**VALID, "num_frames": -7},
        {**VALID, "seed": -1},
        {**VALID, "steps": 10**9},
        {**VALID, "width": "64"},
        {**VALID, "images": [{"data": "!!not base64!!"}]},
        {**VALID, "images": [{"data": "QUFBQQ==", "frame": 3}]},
        {**VALID, "output_path": "/etc/passwd"},
        {**VALID, "__class__": "os.system"},
        {**VALID, "frame_rate": math.inf},
        {**VALID, "frame_rate": 1e-300},  # killed a rank on every attempt (an OverflowError)
        {**VALID, "frame_rate": 1e-6},  # a 115 GB allocation
        {**VALID, "images": [{"data": _LYING_WEBP}]},  # a 16x16 canvas around a 16000x16000 bitstream
        ["prompt", "a list, not an object"],
        "just a string",
        None,
        12345,
    ]


def is_bad(request: Any) -> bool:
    """The oracle: the real schema rejects it."""
    try:
        RenderRequest.model_validate(request)
    except Exception:
        return True
    return False


def _draw(strategy: Any, count: int, rng_seed: int) -> list[Any]:
    """`count` examples of `strategy`, the same ones for the same seed (hypothesis as a generator)."""
    out: list[Any] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @seed(rng_seed)
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    collect()
    return out


@dataclass
class BadInput:
    """One hostile request and the door it goes through; `outcome` is filled in by the engine/checker."""

    door: str  # cli | enqueue | raw
    payload: Any
    label: str
    job_id: str | None = None
    rejected: bool | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def generate_bad_inputs(rng_seed: int, count: int, *, deep_nesting: bool = True) -> list[Any]:
    """`count` requests the schema rejects: classics first, then hypothesis draws (valid draws dropped)."""
    found: list[Any] = [r for r in _classics() if is_bad(r)]
    if deep_nesting:
        found.append(DeepNest(20_000))
    draws = _draw(_requests, max(count * 3, 20), rng_seed)
    found += [r for r in draws if is_bad(r)]
    return found[:count] if len(found) >= count else found


class DeepNest:
    """A request nested `depth` lists deep: built as text (json.dumps would recurse too deep itself)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def text(self) -> str:
        return '{"prompt": ' + "[" * self.depth + "]" * self.depth + "}"

    def __repr__(self) -> str:
        return f"DeepNest({self.depth})"


def to_text(payload: Any) -> str:
    return payload.text() if isinstance(payload, DeepNest) else json.dumps(payload)


def raw_job_hashes(queue: str, canary_dir: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, job id, hash fields) of hand-written RQ job hashes; push the id onto `rq:queue:<queue>`."""

    def data(func: str, args: list[Any], kwargs: dict[str, Any] | None = None) -> bytes:
        return zlib.compress(json.dumps([func, None, args, kwargs or {}]).encode())

    def fields(payload: bytes | None, **extra: Any) -> dict[str, Any]:
        stamp = "2025-01-01T00:00:00.000000Z"
        base: dict[str, Any] = {"created_at": stamp, "origin": queue, "status": "queued", "description": "hostile",
                                "timeout": 60, "enqueued_at": stamp}  # fmt: skip
        if payload is not None:
            base["data"] = payload
        base.update(extra)
        return base

    def jid() -> str:
        return f"hostile-{uuid.uuid4().hex[:10]}"

    canary = canary_dir / f"canary-{uuid.uuid4().hex[:8]}"
    return [
        ("garbage data (not zlib)", jid(), fields(b"\x00\xffnot zlib at all")),
        ("zlib of non-JSON", jid(), fields(zlib.compress(b"\x80\x04not json"))),
        ("JSON but not a call tuple", jid(), fields(zlib.compress(b'{"a": 1}'))),
        ("a function other than render", jid(), fields(data("os.makedirs", [str(canary)]))),
        ("render with extra args", jid(), fields(data(RENDER_FUNC, [VALID, "extra"], {"evil": 1}))),
        ("render with no args", jid(), fields(data(RENDER_FUNC, []))),
        ("missing data field", jid(), fields(None)),
        ("corrupt meta", jid(), fields(data(RENDER_FUNC, [{**VALID, "width": 65}]), meta=b"\x00not json")),
        ("bad timestamps", jid(), fields(data(RENDER_FUNC, [{**VALID, "width": -1}]), created_at="yesterday")),
        # bigger than any job can be (each value under Redis's 4 MB bulk cap): refused unread and deleted
        ("9 MB job hash", jid(), fields(data(RENDER_FUNC, [VALID]), **{f"pad{i}": b"y" * (3 << 20) for i in range(3)})),
    ]


def canary_paths(canary_dir: Path) -> list[Path]:
    return sorted(canary_dir.glob("canary-*"))
