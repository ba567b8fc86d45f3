"""What a runner accepts in a request, in one place: the request schema (`ltx_contract/schema.py`), the
memory plan's size search (`ltx_mgpu.spec.memory_plan.largest`), `ltx-worker plan`, the runners' own checks on every
rank and the producer (`submit`, `--dry-run`, from the rules each worker publishes: `ltx_contract.limits`)
all read a `RequestRules`, so none of them admits a request another refuses.

- Size: width and height a multiple of `spatial_multiple` (the VAE's 32 px; the ltx2 runners' 64, since
  stage 1 runs at half resolution), at most `max_side`; `num_frames` 8k+1 (one latent frame per 8 after the
  first), at most `max_frames`.
- Duration: `num_frames / frame_rate` seconds of audio is generated, held and decoded (the audio sequence is
  not sharded); `max_duration_s` bounds it (None: only the token budget does).
- Fields a runner cannot use (`refused_fields`: the distilled runner's negative prompt, steps, guidance) are
  refused, never ignored; `steps` within `steps_range` where the runner takes steps.

A request a rule refuses raises `RequestRuleError` (a `ValueError` naming the field): on a rank, the
controller reports it as a refused request (`invalid_request`), not as a runner error.

Stdlib only (the producer imports it through the schema; tests/test_import_contracts.py holds it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ltx_mgpu.errors import LtxMgpuError
from ltx_mgpu.spec.bounds import RANGES

__all__ = [
    "GENERIC",
    "MAX_DURATION_S",
    "MAX_PIXELS",
    "PRESETS",
    "RequestRuleError",
    "RequestRules",
    "ltx2_rules",
]

VAE_SPATIAL = 32  #: LTX-2's video VAE: one latent cell per 32 x 32 px ...
VAE_TEMPORAL = 8  #: ... and per 8 frames after the first
#: The longest clip (audio included) the ltx2 runners render: LTX-2's hosted API serves up to 20 s; 30 s
#: leaves room for 481 frames at 16 fps. Past it, the audio decode alone grows by ~16 MB of rank memory per
#: second (on the CPU stack, 64x64x257 at 1 fps held 4.86 GB against 0.77 GB at 25 fps).
MAX_DURATION_S = 30.0
MAX_PIXELS = 3840 * 2176  #: the largest frame: 4K UHD rounded up to multiples of 64
#: The sizes users ask for (WIDTHxHEIGHTxFRAMES): 5 s and 10 s at 1536x1024, 10 s and 20 s at 1080p, 5 s at 4K.
PRESETS = ("1536x1024x241", "1920x1088x241", "1920x1088x481", "3840x2176x121")

#: Why a runner refuses a field it cannot use (the message a client reads).
_REFUSED_WHY = {
    "negative_prompt": "uses no negative prompt (it runs without CFG)",
    "steps": "has a fixed schedule; leave steps unset",
    "guidance_scale": "runs without guidance; leave guidance_scale unset",
}


class RequestRuleError(LtxMgpuError, ValueError):
    """A request a runner's rules refuse; `field` names the request field (or "size")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # (crosses the rank -> controller pipe)
        return (type(self), (self.field, str(self)))


def _unset(value: Any) -> bool:
    return value is None or value == ""


@dataclass(frozen=True)
class RequestRules:
    """The request rules of one runner (with its setup). `problems()` lists every refusal; `check()` raises
    the first; `fit_size()` is the nearest size at or below a given one that the size rules accept."""

    runner: str
    spatial_multiple: int = VAE_SPATIAL
    temporal_multiple: int = VAE_TEMPORAL
    max_side: int = int(RANGES["width"][1])
    max_frames: int = int(RANGES["num_frames"][1])
    max_pixels: int = MAX_PIXELS  #: width x height (portrait or landscape 4K)
    max_duration_s: float | None = None
    refused_fields: tuple[str, ...] = ()
    steps_range: tuple[int, int] | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("spatial_multiple", "temporal_multiple", "max_side", "max_frames", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.spatial_multiple % VAE_SPATIAL or self.temporal_multiple % VAE_TEMPORAL:
            raise ValueError("the multiples must be multiples of the VAE's (32 px, 8 frames)")
        if self.max_duration_s is not None and not (
            isinstance(self.max_duration_s, int | float) and 0 < self.max_duration_s < 1e6
        ):
            raise ValueError(f"max_duration_s must be a positive number, got {self.max_duration_s!r}")
        unknown = set(self.refused_fields) - set(_REFUSED_WHY)
        if unknown:
            raise ValueError(f"refused_fields names fields that cannot be refused: {sorted(unknown)}")

    # ---- the checks ------------------------------------------------------------------------------------
    def size_problem(self, width: int, height: int, num_frames: int) -> str | None:
        """Why the size rules refuse `width x height x num_frames` (None: they accept it)."""
        m, t = self.spatial_multiple, self.temporal_multiple
        if width % m or height % m or not (m <= width <= self.max_side and m <= height <= self.max_side):
            return (
                f"width and height must be multiples of {m} from {m} to {self.max_side} (runner "
                f"{self.runner!r}), got {width}x{height}"
            )
        if width * height > self.max_pixels:
            return (
                f"{width}x{height} is {width * height} pixels a frame, over the {self.max_pixels} (e.g. "
                f"3840x2176) runner {self.runner!r} renders"
            )
        if num_frames < 1 or (num_frames - 1) % t or num_frames > self.max_frames:
            return (
                f"num_frames must be {t}k+1 (1, {t + 1}, {2 * t + 1}, ...) up to {self.max_frames} (runner "
                f"{self.runner!r}), got {num_frames}"
            )
        return None

    def problems(self, fields: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(field, message) of every rule `fields` (request fields; absent: the default) breaks."""
        out: list[tuple[str, str]] = []
        w, h, f = (fields.get(k) for k in ("width", "height", "num_frames"))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (w, h, f)):
            if (size := self.size_problem(int(w), int(h), int(f))) is not None:  # type: ignore[arg-type]
                out.append(("size", size))
            rate = fields.get("frame_rate")
            if self.max_duration_s is not None and isinstance(rate, int | float) and rate > 0:
                seconds = int(f) / float(rate)  # type: ignore[arg-type]
                if seconds > self.max_duration_s:
                    out.append(
                        (
                            "frame_rate",
                            f"the clip is {f} frames at {rate:g} fps = {seconds:.1f} s (video and "
                            f"audio), over the {self.max_duration_s:g} s runner {self.runner!r} renders; "
                            "use a higher frame_rate or fewer frames",
                        )
                    )
        for name in self.refused_fields:
            if not _unset(fields.get(name)):
                out.append((name, f"runner {self.runner!r} {_REFUSED_WHY[name]}"))
        steps = fields.get("steps")
        if self.steps_range is not None and "steps" not in self.refused_fields and not _unset(steps):
            low, high = self.steps_range
            if not low <= steps <= high:  # type: ignore[operator]
                out.append(("steps", f"steps must be in [{low}, {high}] (runner {self.runner!r}), got {steps}"))
        return out

    def check(self, **fields: Any) -> None:
        """`RequestRuleError` for the first rule `fields` break (every rank calls it before any collective)."""
        if found := self.problems(fields):
            raise RequestRuleError(*found[0])

    # ---- sizes -----------------------------------------------------------------------------------------
    def fit_size(self, width: int, height: int, num_frames: int) -> tuple[int, int, int] | None:
        """The largest size at or below the given one on every axis that the size rules accept (None: none)."""
        m, t = self.spatial_multiple, self.temporal_multiple
        w, h = (min(int(v), self.max_side) // m * m for v in (width, height))
        while w >= m and h >= m and w * h > self.max_pixels:  # shrink the longer side first
            w, h = (w - m, h) if w >= h else (w, h - m)
        f = min(int(num_frames), self.max_frames)
        f = (f - 1) // t * t + 1 if f >= 1 else 0
        return (w, h, f) if w >= m and h >= m and f >= 1 else None

    def largest_frame(self) -> tuple[int, int]:
        """The (width, height) with the most pixels the size rules accept (the most tokens a request can have)."""
        m = self.spatial_multiple
        best = (m, m)
        for h in range(m, self.max_side + 1, m):
            w = min(self.max_side, self.max_pixels // h) // m * m
            if w >= m and w * h > best[0] * best[1]:
                best = (w, h)
        return best

    def frame_counts(self, below: int) -> range:
        """The frame counts the rules accept, from `below` (clipped) down to 1."""
        top = self.fit_size(self.spatial_multiple, self.spatial_multiple, max(1, int(below)))
        return range(top[2] if top else 1, 0, -self.temporal_multiple)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["refused_fields"] = list(self.refused_fields)
        out["steps_range"] = None if self.steps_range is None else list(self.steps_range)
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_json(cls, data: Any) -> RequestRules | None:
        """What a worker published; None when missing or malformed (an older worker: nothing to check)."""
        if not isinstance(data, Mapping):
            return None
        try:
            kw = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            for name in ("refused_fields", "notes"):
                if name in kw:
                    kw[name] = tuple(str(x) for x in kw[name])
            if kw.get("steps_range") is not None:
                low, high = kw["steps_range"]
                kw["steps_range"] = (int(low), int(high))
            return cls(**kw)
        except (TypeError, ValueError, KeyError):
            return None


#: What every LTX-2 runner accepts (the request schema's structural rules; a runner narrows them).
GENERIC = RequestRules("any")

LTX2_DEFAULT_MAX_STEPS = 100  #: `Ltx2Runner.setup(max_steps=...)`'s default (tests hold them equal)


def ltx2_rules(kind: str, setup_kwargs: Mapping[str, Any] | None = None) -> RequestRules:
    """The rules of the ltx2 runners: "distilled" (fixed schedule, no guidance) or "two-stage"."""
    setup = dict(setup_kwargs or {})
    name = {"distilled": "ltx2-distilled", "two-stage": "ltx2-two-stage"}[kind]
    common = {"spatial_multiple": 2 * VAE_SPATIAL, "max_duration_s": MAX_DURATION_S}
    if kind == "distilled":
        return RequestRules(name, refused_fields=("negative_prompt", "steps", "guidance_scale"), **common)
    return RequestRules(name, steps_range=(2, int(setup.get("max_steps", LTX2_DEFAULT_MAX_STEPS))), **common)
