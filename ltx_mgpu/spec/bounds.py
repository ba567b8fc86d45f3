"""The bounds of a render request, in one place: the service's request schema (`ltx_contract/schema.py`, which the
producer uses for `submit` and `--dry-run`), the worker's published runner limits (`ltx_contract/limits.py`) and
the runners' own validation (`runners/common/args.py`, on every rank before any collective) all read them
here, so the edge, the worker and a rank refuse the same requests.

Stdlib only: the producer imports this module (the one exception to "producer never imports ltx_mgpu",
held by tests/test_import_contracts.py), so it must never bring in torch.

Why each bound is what it is (a request outside one cost a fleet before; docs/security.md):
- `frame_rate` in [1, 120] fps. LTX-2 was trained on real video (24 to 50 fps); its RoPE time positions
  are frame index / fps, and the audio track is num_frames / fps seconds long. At 1e-300 fps the audio
  length overflowed (OverflowError on a rank: the rank died); at 1e-6 fps it asked for 225 M audio latents
  (a 115 GB allocation). Below 1 fps a 257-frame request is over 4 minutes of audio; above 120 fps nothing
  plays it and the model has never seen it.
- The audio length in latents (`audio_latents`: num_frames / frame_rate x 25, LTX-2's audio latent rate:
  16 kHz, hop 160, x4 down) is checked against the runner's token budget (`check_audio_budget`): the audio
  sequence is not sharded, every rank holds and attends over all of it.
- Every number finite (JSON accepts `NaN` and `Infinity`) and of its type: a bool is not a number, and an
  int field is not a float (a 5000-digit integer is refused here by size, not by Python's int-to-str limit).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "AUDIO_LATENTS_PER_SECOND",
    "FLOAT_FIELDS",
    "INT_FIELDS",
    "MAX_FRAME_RATE",
    "MIN_FRAME_RATE",
    "RANGES",
    "audio_latents",
    "check_audio_budget",
    "check_number",
    "check_numbers",
]

MIN_FRAME_RATE = 1.0
MAX_FRAME_RATE = 120.0
AUDIO_LATENTS_PER_SECOND = 25  #: LTX-2's audio latent rate (16 kHz, hop 160, x4 downsampling)

#: Inclusive ranges of the numeric request fields (and of a conditioning image's `frame` and `strength`).
RANGES: dict[str, tuple[float, float]] = {
    "seed": (0, 2**32 - 1),
    "width": (32, 3840),  # 4K (3840x2176): the largest preset (`request_rules.PRESETS`); the plan decides the rest
    "height": (32, 3840),
    "num_frames": (1, 481),  # 20 s at 24 fps
    "frame_rate": (MIN_FRAME_RATE, MAX_FRAME_RATE),
    "steps": (1, 200),
    "guidance_scale": (1.0, 20.0),
    "frame": (0, 480),
    "strength": (0.0, 1.0),
}
INT_FIELDS = frozenset({"seed", "width", "height", "num_frames", "steps", "frame"})
FLOAT_FIELDS = frozenset(RANGES) - INT_FIELDS


def check_number(name: str, value: Any) -> float | int:
    """`value` as the number field `name` takes, or `ValueError` naming the field (never another error type:
    a rank raises this identically everywhere, before any collective, and the fleet survives it)."""
    low, high = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if name in INT_FIELDS and not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if not low <= value <= high:  # (int vs float comparisons are exact: no overflow for any int)
        shown = value if isinstance(value, float) or abs(value) < 10**30 else f"an integer of {_digits(value)} digits"
        raise ValueError(f"{name} must be in [{_num(low)}, {_num(high)}], got {shown}")
    return value


def check_numbers(**fields: Any) -> None:
    """`check_number` for every field given that is not None (None: the runner's default applies)."""
    for name, value in fields.items():
        if value is not None:
            check_number(name, value)


def audio_latents(num_frames: int, frame_rate: float) -> int:
    """The audio sequence length of a request: its duration (num_frames / frame_rate s) x 25 latents/s.
    Call it with checked values (`check_number`): it is exact for every request inside `RANGES`."""
    return max(1, round(num_frames / frame_rate * AUDIO_LATENTS_PER_SECOND))


def check_audio_budget(num_frames: int, frame_rate: float, max_tokens: int) -> None:
    """`ValueError` when the request's audio sequence exceeds the runner's token budget."""
    check_number("num_frames", num_frames)
    check_number("frame_rate", frame_rate)
    tokens = audio_latents(num_frames, frame_rate)
    if tokens > max_tokens:
        raise ValueError(
            f"the audio track ({num_frames} frames at {frame_rate:g} fps = {num_frames / frame_rate:.1f} s, "
            f"{tokens} audio latents) exceeds the runner's token budget ({max_tokens}). "
            "Use a higher frame_rate or fewer frames."
        )


def _digits(value: int) -> int:
    return int(math.log10(abs(value))) + 1  # (str() of a 5000-digit int raises: Python's int-to-str limit)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
