"""Loading checks shared by every runner: files that must exist, checkpoint metadata, and models that must
come out of ltx-core's builders fully materialised.

ltx-core's `SingleGPUModelBuilder` loads with `strict=False` and, when keys are missing, silently returns a
model still on the meta device; `build_checked` turns that into a `RuntimeError` naming the file and the
first missing tensors. Checkpoints written by our synthetic generator say `synthetic: "true"` in their
safetensors metadata; `warn_if_synthetic` logs that once per setup, because anything rendered from them is
noise (only their timings and memory are real).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "build_checked",
    "build_sp_transformer",
    "check_materialized",
    "checkpoint_metadata",
    "file_builder",
    "is_synthetic",
    "require_file",
    "warn_if_synthetic",
]

log = logging.getLogger("ltx_mgpu.runners")


def require_file(path: str | Path, what: str) -> str:
    """`str(path)` if it is a file, else `FileNotFoundError` naming `what`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    return str(p)


def file_builder(
    configurator: Any, path: str | Path, what: str, *, sd_ops: Any = None, module_ops: Any = (), registry: Any = None
) -> Any:
    """ltx-core's `SingleGPUModelBuilder` for `configurator` over the safetensors file `path` (which must
    exist: `FileNotFoundError` naming `what`), with the loader's key ops and module ops; CUDA loads read
    through `fast_load.StagedSafetensorsLoader`."""
    from ltx_core.loader.registry import DummyRegistry
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

    from .fast_load import staged_model_loader

    return SingleGPUModelBuilder(
        configurator,
        require_file(path, what),
        model_sd_ops=sd_ops,
        module_ops=tuple(module_ops),
        model_loader=staged_model_loader(),  # weights to the GPU through pinned buffers (see fast_load)
        registry=registry or DummyRegistry(),
    )


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The safetensors metadata of `path` with the `config` entry parsed (empty dict when absent)."""
    from safetensors import safe_open

    with safe_open(require_file(path, "checkpoint"), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if "config" in meta:
        meta["config"] = json.loads(meta["config"])
    return meta


def is_synthetic(metadata: dict[str, Any]) -> bool:
    """True for checkpoints our generator wrote (seeded random weights)."""
    return str(metadata.get("synthetic", "")).lower() == "true"


def warn_if_synthetic(path: str | Path, *, announce: bool = True) -> bool:
    """True if the checkpoint at `path` is synthetic; logs a warning once when `announce` (the driver)."""
    synthetic = is_synthetic(checkpoint_metadata(path))
    if synthetic and announce:
        log.warning(
            "%s holds SYNTHETIC weights (seeded random, written by ltx_mgpu.runners.ltx2.synthetic): renders "
            "from synthetic weights are noise; only their timings and memory are real",
            path,
        )
    return synthetic


def check_materialized(model: torch.nn.Module, what: str) -> torch.nn.Module:
    """Fail clearly if any parameter or buffer of `model` is still on meta; else eval() and no grad."""
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise RuntimeError(
            f"{what}: {len(meta)} tensors are still on the meta device after loading (first: {meta[:3]}); the "
            "checkpoint lacks them or has another key layout"
        )
    return model.eval().requires_grad_(False)


def build_checked(builder: Any, device: torch.device, dtype: torch.dtype | None, what: str) -> torch.nn.Module:
    """`builder.build(device, dtype)`, then `check_materialized` (naming the builder's file)."""
    model = builder.build(device=torch.device(device), dtype=dtype)
    return check_materialized(model, f"{what} ({builder.model_path})")


def build_sp_transformer(
    builder: Any,
    runner: Any,
    *,
    max_tokens: int,
    dtype: torch.dtype,
    backend: str,
    build_dtype: torch.dtype | None,
    layouts: bool = False,
    laps: Any = None,
) -> tuple[Any, torch.nn.Module]:
    """The attention manager sized from the transformer config of `builder` and the sequence-parallel
    transformer built from it on `runner`'s device and transformer group (`build_dtype` None: keep the
    checkpoint's dtypes, e.g. fp8 weights).

    `layouts`: an `AttentionRouter` over every G x S layout of the fleet (collective: the layout groups are
    made here, once) instead of one manager over the whole fleet, so guidance-parallel stages can run the
    same resident model under smaller SP groups. `laps` (a `SetupLaps`): time the attention set-up (groups,
    exchange buffers) and the model build (weights) apart."""
    from ...parallel import AttentionManager, AttentionRouter, SequenceParallelBuilder
    from ...parallel.layouts.layout import layout_groups

    cfg = builder.model_config()["transformer"]
    heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["attention_head_dim"])
    if layouts:
        attention: Any = AttentionRouter.build(
            layout_groups(runner),
            int(max_tokens),
            heads,
            head_dim,
            dtype,
            backend=backend,
            device=runner.device,
            head_counts=(int(cfg.get("audio_num_attention_heads", 32)),),  # ltx-core's default
        )
    else:
        attention = AttentionManager(
            int(max_tokens),
            heads,
            head_dim,
            dtype,
            runner.groups.transformer_group,
            backend=backend,
            device=runner.device,
        )
    if laps is not None:
        laps.lap("sp_attention")
    model = SequenceParallelBuilder(builder, attention).build(device=runner.device, dtype=build_dtype)
    if laps is not None:
        laps.lap("transformer")
    return attention, model
