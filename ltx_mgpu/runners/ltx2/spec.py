"""What the ltx2 runners are, without the runners: their request rules, request limits and memory-plan inputs
from their setup kwargs alone. The runner classes answer with these functions (`Ltx2Runner.request_rules`,
`request_limits`, `memory_fleet`), and `ltx-worker plan` and the worker's published limits read them here
without importing torch (`describe`), so a plan never costs seconds of imports and never disagrees with the
runner.

Stdlib only (tests/test_import_contracts.py holds it; `ltx_mgpu.runners` and this package import nothing
heavy).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...spec.memory_plan import DEFAULT_REQUEST_LORAS, FleetMemory, sp_tokens
from ...spec.placement import TIERS
from ...spec.request_rules import RequestRules, ltx2_rules

__all__ = [
    "QUANTIZATIONS",
    "RUNNER_KINDS",
    "SETUP_DEFAULTS",
    "describe",
    "memory_fleet",
    "placement",
    "request_limits",
    "request_rules",
]

#: the setup `quantization` names (None: bf16); `components.quantization_policy` builds each
QUANTIZATIONS = ("fp8-cast", "fp8-scaled-mm", "fp8-mm", "fp8-mm+attn")

#: The registry import paths of the ltx2 runners and their kind (`memory_plan.FleetMemory.runner`).
RUNNER_KINDS = {
    "ltx_mgpu.runners.ltx2.runners:Ltx2DistilledRunner": "distilled",
    "ltx_mgpu.runners.ltx2.distilled:Ltx2DistilledRunner": "distilled",
    "ltx_mgpu.runners.ltx2.runners:Ltx2TwoStageRunner": "two-stage",
    "ltx_mgpu.runners.ltx2.two_stage:Ltx2TwoStageRunner": "two-stage",
}
#: `Ltx2Runner.setup()`'s defaults this module needs (the setup signature uses these constants).
SETUP_DEFAULTS: dict[str, Any] = {
    "sp_max_tokens": None,
    "vae_overlap": 1,
    "lora_device_cache_gib": 4.0,
    "max_steps": 100,
}
#: Stage-1 guidance defaults (the reference's LTX-2 values): `two_stage.VIDEO_GUIDANCE` / `AUDIO_GUIDANCE`.
VIDEO_GUIDANCE = {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0}
AUDIO_GUIDANCE = {**VIDEO_GUIDANCE, "cfg_scale": 7.0}


def _setup(name: str, setup_kwargs: Mapping[str, Any]) -> Any:
    return setup_kwargs[name] if name in setup_kwargs else SETUP_DEFAULTS[name]


def passes(kind: str, setup_kwargs: Mapping[str, Any]) -> int:
    """Transformer passes per stage-1 step: the conditional one, plus one per guidance term either modality
    uses (CFG, STG, modality isolation): 4 with the reference's defaults, 2 with CFG only; 1 distilled."""
    if kind == "distilled":
        return 1
    overrides = dict(setup_kwargs.get("stage1_guidance") or {})
    params = [
        {**base, **{k: float(v) for k, v in dict(overrides.get(name) or {}).items()}}
        for name, base in (("video", VIDEO_GUIDANCE), ("audio", AUDIO_GUIDANCE))
    ]
    terms = [
        any(g["cfg_scale"] != 1.0 for g in params),
        any(g["stg_scale"] != 0.0 for g in params),
        any(g["modality_scale"] != 1.0 for g in params),
    ]
    return 1 + sum(terms)


def request_rules(kind: str, setup_kwargs: Mapping[str, Any]) -> RequestRules:
    """The request rules of this runner with this setup (`request_rules.ltx2_rules`)."""
    return ltx2_rules(kind, {"max_steps": int(_setup("max_steps", setup_kwargs))})


def memory_fleet(kind: str, world_size: int, setup_kwargs: Mapping[str, Any]) -> FleetMemory:
    """The runner's inputs to the memory plan on `world_size` ranks. The profile is the 19B one unless the
    checkpoint is a small (tiny test) file; no checkpoint at hand: the 19B one."""
    ckpt = setup_kwargs.get("checkpoint_path")
    small = bool(ckpt) and os.path.isfile(str(ckpt)) and os.path.getsize(str(ckpt)) < (1 << 30)
    te_rank = setup_kwargs.get("text_encoder_rank")
    lora_files = [str(p) for p, *_ in setup_kwargs.get("loras") or ()]
    if kind == "two-stage" and setup_kwargs.get("distilled_lora_path"):
        lora_files.append(str(setup_kwargs["distilled_lora_path"]))
    request = bool(setup_kwargs.get("request_loras"))
    found = bool(lora_files) and all(os.path.isfile(p) for p in lora_files)  # else: the profile's LoRA
    budget = _setup("sp_max_tokens", setup_kwargs)
    where = placement(setup_kwargs)
    return FleetMemory(
        kind,
        int(world_size),
        profile="tiny" if small else "ltx2-19b",
        lora_tracker=bool(lora_files) or request or kind == "two-stage",
        setup_lora_gib=sum(os.path.getsize(p) for p in lora_files) / (1 << 30) if found else None,
        request_loras=DEFAULT_REQUEST_LORAS if request else 0,
        lora_device_cache_gib=float(_setup("lora_device_cache_gib", setup_kwargs) or 0.0),
        text_encoder_rank=None if te_rank is None else int(te_rank),
        gemma_every_rank=setup_kwargs.get("text_encoder") == "batch-parallel",
        fp8_transformer=str(setup_kwargs.get("quantization") or "").startswith("fp8"),
        passes=passes(kind, setup_kwargs),
        vae_overlap=int(_setup("vae_overlap", setup_kwargs)),
        sp_max_tokens=None if budget is None else int(budget),
        text_encoder_at=where["text_encoder"],
        lora_backup_at=where["lora_backup"],
        lora_factors_at=where["lora_factors"],
    )


def placement(setup_kwargs: Mapping[str, Any]) -> dict[str, str]:
    """The setup kwarg `placement` (`ltx_mgpu.spec.placement.TIERS`), every component named, defaults "gpu"; a
    `ValueError` for an unknown component or tier (checked the same way by the runner's setup on every rank)."""
    given = setup_kwargs.get("placement") or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"placement must be a mapping of component -> tier, got {type(given).__name__}")
    unknown = sorted(set(given) - set(TIERS))
    if unknown:
        raise ValueError(f"placement: unknown component(s) {unknown}; known: {sorted(TIERS)}")
    out = {}
    for component, tiers in TIERS.items():
        tier = str(given.get(component, tiers[0]))
        if tier not in tiers:
            raise ValueError(f"placement[{component!r}] must be one of {tiers}, got {tier!r}")
        out[component] = tier
    return out


def request_limits(kind: str, setup_kwargs: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """The audio length within the SP token budget (what `_validate` enforces on every rank)."""
    return {"audio_latents": (1, sp_tokens(memory_fleet(kind, 1, setup_kwargs)))}


def describe(path: str) -> str | None:
    """The kind of the ltx2 runner at registry path `path` (None: not an ltx2 runner)."""
    return RUNNER_KINDS.get(path)
