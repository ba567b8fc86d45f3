"""Device groups, the runner, the fleet's life and the retry policy (fields of `WorkerSettings`).

Runners are chosen by *name* from the `runners` registry (`name → "module:Class"`); the class is imported
only when a worker process builds its fleet (`resolve_runner`), so settings (and the supervisor) never
import torch.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import NoDecode

from ltx_contract.shared_settings import split_list
from ltx_mgpu.control.devices import canonical_group
from worker.settings.base import ENV_PREFIX, SettingsError

__all__ = ["BUILTIN_RUNNERS", "FleetFields", "group_label", "resolve_runner", "validate_group"]

#: Runners every worker knows. Import paths, so nothing is imported until a fleet is built.
BUILTIN_RUNNERS: dict[str, str] = {
    "smoke": "ltx_mgpu.runners.smoke:SmokeRunner",
    "noop": "ltx_mgpu.runners.noop:NoopRunner",
    "ltx2-distilled": "ltx_mgpu.runners.ltx2.runners:Ltx2DistilledRunner",
    "ltx2-two-stage": "ltx_mgpu.runners.ltx2.runners:Ltx2TwoStageRunner",
}


def validate_group(spec: str) -> str:
    """Check a device group spec and return its canonical spelling ("cpu", "cpu:2", "0,1,2,3").

    The engine's own parser (`ltx_mgpu.control.devices`, torch-free), so what passes here is what the fleet runs on.
    """
    return canonical_group(spec)


def group_label(spec: str) -> str:
    """A name-safe label for a group ("0,1,2,3" → "g0-1-2-3", "cpu:2" → "cpu2")."""
    text = validate_group(spec)
    if text.startswith("cpu"):
        return "cpu" + (text.split(":")[1] if ":" in text else "1")
    return "g" + text.replace(",", "-")


class FleetFields(BaseModel):
    """Fleet, runner and retry fields."""

    # ---- fleets --------------------------------------------------------------------------------------
    groups: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["cpu:1"],
        description="device groups, one worker process each: 'cpu:2', '0,1,2,3' (';'-separated or JSON)",
    )
    runner: str = Field("smoke", description="name of the runner (a key of `runners`)")
    runners: dict[str, str] = Field(
        default_factory=dict, description="extra runners: name → 'module:Class' (merged over the built-ins)"
    )
    runner_setup: dict[str, Any] = Field(default_factory=dict, description="kwargs for the runner's setup()")
    fleet_start_timeout: float = Field(1800.0, gt=0, description="seconds for a fleet to start (model load)")
    warmup_requests: list[dict[str, Any]] = Field(
        default_factory=list,
        description="requests (RenderRequest JSON) rendered once after every fleet start, before the first job "
        "(compilation, allocator growth, caches for these sizes); their time is the warm-up of cold start",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        description="GiB each device offers the fleet's memory plan (ltx_mgpu.spec.memory_plan); unset: "
        "measured after the warm-up on GPU fleets, no limit on CPU fleets",
    )
    memory_headroom_gib: float = Field(
        4.0, ge=0, description="GiB the memory plan keeps free on every device beyond its predicted peak"
    )
    placement: str = Field(
        "auto",
        description="where the fleet keeps its text encoder and its LoRA tracker's copies "
        "(ltx_mgpu.spec.placement): auto = the fastest placement that fits the card and the host memory, chosen "
        "before the fleet loads (a fleet that fits none is refused: exit 2); or JSON, e.g. "
        '{"text_encoder": "park", "lora_backup": "host", "lora_factors": "host"} (unnamed parts stay on the GPU)',
    )
    host_memory_gib: float | None = Field(
        None,
        gt=0,
        description="GiB of pinned host memory this worker's fleet may take for its placement's host "
        "tiers; unset: the memory available at start less 8 GiB, shared equally by the groups",
    )
    render_timeout: float = Field(3600.0, gt=0, description="seconds one render may take in the fleet")
    fleet_shutdown_timeout: float = Field(30.0, ge=0, description="graceful seconds when stopping a fleet")
    fleet_error_settle_s: float = Field(
        30.0,
        gt=0,
        description="once some ranks ended a job with an error, seconds the others get to end it too "
        "before the fleet is taken to be stuck in a collective and rebuilt",
    )
    deterministic: Literal["auto", "on", "off", "strict"] = Field(
        "auto",
        description="deterministic renders (same request, seed, layout and software: the same frames and "
        "audio; ltx_mgpu.control.determinism): on, strict (torch refuses every nondeterministic op, cuDNN's "
        "attention included), off (the opt-out: buys back the mode's cost, docs/runners.md); auto = on for CPU "
        "and GPU fleets alike",
    )
    max_rebuild_failures: int = Field(
        3, ge=1, description="consecutive failed fleet (re)builds after which the worker exits non-zero"
    )
    rebuild_backoff_s: float = Field(2.0, ge=0, description="first back-off between failed rebuilds (doubles)")
    restart_backoff_s: float = Field(
        1.0,
        ge=0,
        description="supervisor: first wait before restarting a worker that exited before it was ever "
        "ready (doubles per such exit in a row); a worker that was ready is restarted after this",
    )
    restart_backoff_max_s: float = Field(60.0, ge=0, description="supervisor: the cap of that back-off")
    restart_alarm_after: int = Field(
        3,
        ge=1,
        description="supervisor: never-ready exits in a row from which it logs critical, sets "
        "ltx_supervisor_crash_loop and answers /readyz 503",
    )

    # ---- retry policy (the worker decides per failure reason; RQ Retry objects are overridden) ------
    retry_fleet_failure: int = Field(1, ge=0, description="re-queues after a fleet failure")
    retry_worker_lost: int = Field(1, ge=0, description="re-queues after the worker vanished mid-job")
    retry_worker_shutdown: int = Field(1, ge=0, description="re-queues after a cold stop mid-job")
    retry_upload_failed: int = Field(1, ge=0, description="re-queues after all upload attempts failed")
    retry_job_timeout: int = Field(0, ge=0, description="re-queues after RQ's job_timeout fired")
    retry_spool_error: int = Field(1, ge=0, description="re-queues after the spool could not hold the render")
    max_attempts: int = Field(
        5, ge=1, description="hard cap on executions of one job, whatever the reasons (bounds every retry path)"
    )

    @field_validator("placement")
    @classmethod
    def _check_placement(cls, value: str) -> str:
        if value.strip() == "auto":
            return "auto"
        from ltx_mgpu.runners.ltx2.spec import placement

        try:
            given = json.loads(value)
            placement({"placement": given})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"placement must be 'auto' or a JSON object of component -> tier: {exc}") from None
        return json.dumps(given, sort_keys=True)

    @field_validator("groups", mode="before")
    @classmethod
    def _parse_groups(cls, value: Any) -> Any:
        return split_list(value, ";")

    @field_validator("groups")
    @classmethod
    def _check_groups(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one device group is needed")
        groups = [validate_group(g) for g in value]
        gpus = [int(i) for g in groups if not g.startswith("cpu") for i in g.split(",")]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"groups {groups} share a GPU; groups must be disjoint")
        return groups

    @field_validator("warmup_requests")
    @classmethod
    def _check_warmup(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from ltx_contract.schema import RenderRequest

        for i, request in enumerate(value):
            try:
                RenderRequest.model_validate(request)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err.get("loc", ())) or "(request)"
                raise ValueError(f"request {i}: field {where!r}: {err.get('msg')}") from None
        return value

    @field_validator("runners")
    @classmethod
    def _check_runner_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not re.fullmatch(r"[\w.]+:[\w.]+", path):
                raise ValueError(f"runner {name!r}: {path!r} is not 'module:Class'")
        return value

    @property
    def runner_registry(self) -> dict[str, str]:
        return {**BUILTIN_RUNNERS, **self.runners}

    def warmup_jobs(self) -> list[dict[str, Any]]:
        """The warm-up requests as runner job kwargs (unset fields left to the runner, like real jobs)."""
        from ltx_contract.schema import RenderRequest

        return [RenderRequest.model_validate(r).runner_kwargs() for r in self.warmup_requests]


def resolve_runner(settings: FleetFields) -> type:
    """Import the configured runner class (in the worker process only: this may import torch)."""
    path = settings.runner_registry[settings.runner]
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"runner ({ENV_PREFIX}RUNNER) {settings.runner!r}: cannot import {path}: {exc}") from exc
    if not isinstance(obj, type):
        raise SettingsError(f"runner {settings.runner!r}: {path} is not a class")
    return obj
