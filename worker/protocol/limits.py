"""A runner's request limits, known at the edge: published by every worker, checked by `producer submit`
(and `--dry-run`) before anything is enqueued, and by the worker before it renders.

The request schema (`worker.protocol.schema`) holds what any LTX-2 runner accepts; a runner narrows it (the smoke
model takes at most 50 steps). Before, a request over such a limit passed `--dry-run` and `submit` and
failed in the worker with `runner_error`. Now the runner class states its limits
(`MGPURunner.request_limits(**setup_kwargs)`, no fleet needed), the worker writes them into its health
snapshot in Redis (`limits`, next to `queues` and `runner`; it expires with the worker), and the producer
checks a request against every live worker on the target queue: any of them may take the job.

Imports only pydantic and the schema, so the producer can use it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ltx_mgpu.bounds import audio_latents
from worker.protocol.schema import RenderRequest

__all__ = ["DERIVED", "LimitViolation", "RunnerLimits"]

#: Limits on quantities derived from several fields (a runner may publish these names too), with what they are.
DERIVED = {
    "audio_latents": ("the audio length in latents: num_frames / frame_rate x 25",
                      lambda r: audio_latents(r.num_frames, r.frame_rate)),
}  # fmt: skip


@dataclass(frozen=True)
class LimitViolation:
    """One request field outside a runner's range."""

    field: str
    value: float
    low: float
    high: float
    runner: str

    def message(self) -> str:
        what = f" ({DERIVED[self.field][0]})" if self.field in DERIVED else ""
        return f"{self.field}{what}: {_num(self.value)} is outside [{_num(self.low)}, {_num(self.high)}] " \
               f"accepted by runner {self.runner!r}"  # fmt: skip


@dataclass(frozen=True)
class RunnerLimits:
    """Inclusive ranges of request fields one runner accepts (with the setup kwargs it runs with)."""

    runner: str
    ranges: Mapping[str, tuple[float, float]]

    @classmethod
    def of(cls, name: str, runner_cls: type, setup_kwargs: Mapping[str, Any]) -> RunnerLimits:
        """Ask the runner class (no fleet needed). Fields it names must be numeric request fields."""
        publish = getattr(runner_cls, "request_limits", None)
        raw = dict(publish(**setup_kwargs)) if publish is not None else {}
        ranges: dict[str, tuple[float, float]] = {}
        for field, bounds in raw.items():
            if field not in RenderRequest.model_fields and field not in DERIVED:
                raise ValueError(f"runner {name!r} publishes a limit for {field!r}, which is not a request field")
            low, high = (float(b) for b in bounds)
            if low > high:
                raise ValueError(f"runner {name!r}: limit for {field!r} is empty ({low} > {high})")
            ranges[field] = (low, high)
        return cls(name, ranges)

    def to_json(self) -> dict[str, Any]:
        return {"runner": self.runner, "ranges": {k: list(v) for k, v in self.ranges.items()}}

    @classmethod
    def from_json(cls, data: Any) -> RunnerLimits | None:
        """Read what a worker published; None if it is missing or malformed (an older worker)."""
        try:
            ranges = {str(k): (float(v[0]), float(v[1])) for k, v in data["ranges"].items()}
            return cls(str(data["runner"]), ranges)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None

    def violations(self, request: RenderRequest) -> list[LimitViolation]:
        """The fields of `request` outside this runner's ranges (unset fields take the runner's default)."""
        out = []
        for field, (low, high) in self.ranges.items():
            value = DERIVED[field][1](request) if field in DERIVED else getattr(request, field, None)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not low <= value <= high:
                out.append(LimitViolation(field, value, low, high, self.runner))
        return out


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
