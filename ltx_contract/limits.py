"""A runner's request limits, known at the edge: published by every worker, checked by `producer submit`
(and `--dry-run`) before anything is enqueued, and by the worker before it renders.

The request schema (`ltx_contract.schema`) holds what any LTX-2 runner accepts; a runner narrows it (the smoke
model takes at most 50 steps). Before, a request over such a limit passed `--dry-run` and `submit` and
failed in the worker with `runner_error`. Now the runner class states its limits
(`MGPURunner.request_limits(**setup_kwargs)`, no fleet needed), the worker writes them into its health
snapshot in Redis (`limits`, next to `queues` and `runner`; it expires with the worker), and the producer
checks a request against every live worker on the target queue: any of them may take the job.

Memory (`memory`, a `ltx_mgpu.spec.memory_plan.FleetMemory`): a runner that describes its memory
(`memory_fleet(world_size, **setup_kwargs)`, the ltx2 runners) publishes its fleet's layout, profile and the
memory each device offers (`LTX_DEVICE_MEMORY_GIB`, or measured after the warm-up on GPU fleets); a request
its plan says cannot fit (or that is over the runner's SP token budget) is a violation of field `size`,
naming the limit and the largest sizes that fit, at the edge and in the worker alike.

Rules (`rules`, a `ltx_mgpu.spec.request_rules.RequestRules`): what the runner accepts besides ranges (size
multiples and the largest frame, 8k+1 frames, the clip's duration, fields it refuses such as the distilled
runner's negative prompt); the same object the runner checks on every rank, so a request it would refuse is
refused at submit, in one line. A fleet whose text encoder streams from host memory (`memory.text_encoder_at`,
its placement) refuses `enhance_prompt`, here as on its ranks.

Imports only pydantic, the schema and the stdlib-only plan and rules, so the producer can use it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ltx_contract.schema import RenderRequest
from ltx_mgpu.spec import memory_plan
from ltx_mgpu.spec.bounds import audio_latents
from ltx_mgpu.spec.placement import STREAMED_ENHANCE_REFUSAL
from ltx_mgpu.spec.request_rules import RequestRules

__all__ = ["DERIVED", "LimitViolation", "MemoryViolation", "RuleViolation", "RunnerLimits"]

#: Limits on quantities derived from several fields (a runner may publish these names too), with what they are.
DERIVED = {
    "audio_latents": (
        "the audio length in latents: num_frames / frame_rate x 25",
        lambda r: audio_latents(r.num_frames, r.frame_rate),
    ),
}


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
        return (
            f"{self.field}{what}: {_num(self.value)} is outside [{_num(self.low)}, {_num(self.high)}] "
            f"accepted by runner {self.runner!r}"
        )


@dataclass(frozen=True)
class MemoryViolation(LimitViolation):
    """The request's size does not fit the fleet (`ltx_mgpu.spec.memory_plan`): `text` says why and what fits."""

    text: str = ""

    def message(self) -> str:
        return self.text


@dataclass(frozen=True)
class RuleViolation(LimitViolation):
    """A runner's request rule refuses the request (`ltx_mgpu.spec.request_rules`): `text` says which and why."""

    text: str = ""

    def message(self) -> str:
        return self.text


def memory_violation(memory: memory_plan.FleetMemory, request: RenderRequest, runner: str) -> MemoryViolation | None:
    """The refusal of `request` by the memory plan of `memory` (None: it fits)."""
    w, h, f = int(request.width), int(request.height), int(request.num_frames)
    rate = float(request.frame_rate)
    plan = memory_plan.plan(memory, w, h, f, frame_rate=rate)
    refusal = plan.refusal()
    if refusal is None:
        return None
    fits = memory_plan.largest(memory, w, h, f, frame_rate=rate)
    sizes = [s for s in (fits["frames"], fits["area"]) if s]
    what = f"largest that fits: {' or '.join(sizes)}" if sizes else "no size near it fits"
    return MemoryViolation(
        "size",
        plan.peak.reserved_gib,
        0.0,
        plan.limit_gib or 0.0,
        runner,
        text=f"{refusal}; {what} (runner {runner!r})",
    )


@dataclass(frozen=True)
class RunnerLimits:
    """Inclusive ranges of request fields one runner accepts (with the setup kwargs it runs with), and the
    fleet's memory (None: the runner describes none)."""

    runner: str
    ranges: Mapping[str, tuple[float, float]]
    memory: memory_plan.FleetMemory | None = None
    rules: RequestRules | None = None  #: None: the runner states none (the schema's structural rules only)

    def with_capacity(self, capacity_gib: float | None) -> RunnerLimits:
        """The same limits with what each device offers (measured after a warm-up)."""
        if self.memory is None or capacity_gib == self.memory.capacity_gib:
            return self
        return replace(self, memory=replace(self.memory, capacity_gib=capacity_gib))

    @classmethod
    def of(
        cls,
        name: str,
        runner_cls: type,
        setup_kwargs: Mapping[str, Any],
        *,
        world_size: int = 1,
        capacity_gib: float | None = None,
        headroom_gib: float = memory_plan.DEFAULT_HEADROOM_GIB,
        lora_limits: tuple[int, int, int] | None = None,
    ) -> RunnerLimits:
        """Ask the runner class (no fleet needed). Fields it names must be numeric request fields.
        `lora_limits`: the worker's (LoRAs per request, file bytes, rank), what a request's LoRAs may hold."""
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
        describe = getattr(runner_cls, "memory_fleet", None)
        memory = None
        if describe is not None:
            memory = describe(int(world_size), **setup_kwargs)
            if memory is not None:
                memory = replace(memory, capacity_gib=capacity_gib, headroom_gib=float(headroom_gib))
                if lora_limits is not None:
                    memory = memory_plan.with_lora_limits(memory, *lora_limits)
        state = getattr(runner_cls, "request_rules", None)
        rules = state(**setup_kwargs) if state is not None else None
        if rules is not None and not isinstance(rules, RequestRules):
            raise ValueError(f"runner {name!r}: request_rules() must return a RequestRules, got {type(rules).__name__}")
        return cls(name, ranges, memory, rules)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"runner": self.runner, "ranges": {k: list(v) for k, v in self.ranges.items()}}
        if self.memory is not None:
            out["memory"] = self.memory.to_json()
        if self.rules is not None:
            out["rules"] = self.rules.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> RunnerLimits | None:
        """Read what a worker published; None if it is missing or malformed (an older worker)."""
        try:
            ranges = {str(k): (float(v[0]), float(v[1])) for k, v in data["ranges"].items()}
            return cls(
                str(data["runner"]),
                ranges,
                memory_plan.FleetMemory.from_json(data.get("memory")),
                RequestRules.from_json(data.get("rules")),
            )
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
        broken = self.rules.problems(request.model_dump()) if self.rules is not None else []
        if request.enhance_prompt and self.memory is not None and self.memory.text_encoder_at == "stream":
            broken.append(("enhance_prompt", f"{STREAMED_ENHANCE_REFUSAL} (runner {self.runner!r})"))
        out.extend(RuleViolation(field, 0.0, 0.0, 0.0, self.runner, text=text) for field, text in broken)
        if any(field == "size" for field, _ in broken):  # (the plan would only say the same again)
            return out
        if self.memory is not None and (refused := memory_violation(self.memory, request, self.runner)):
            out.append(refused)
        return out


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
