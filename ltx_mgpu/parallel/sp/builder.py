"""`SequenceParallelBuilder`: wraps ltx-core's `SingleGPUModelBuilder` so the transformer it builds runs
sequence-parallel, without changing the inner builder's checkpoint, sd-ops, dtype or LoRA configuration.

The wrapper adds one `ModuleOps` ("video_self_attention_all2all", matching `LTXModel`) to the inner
builder. ltx-core applies module ops to the meta model before weights are assigned, so the attention
patching is part of the model's structure, precedes any later op (quantization, compilation) appended on
top, and costs nothing at load time. `build()` then wraps the model in `SequenceParallelModelWrapper`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .attention import All2AllAttention, AttentionManager, AudioAll2AllAttention
from .wrapper import SequenceParallelModelWrapper

__all__ = ["SP_MODULE_OPS_NAME", "SequenceParallelBuilder", "create_sp_module_ops", "patch_sp_attention"]

SP_MODULE_OPS_NAME = "video_self_attention_all2all"


def _patch(attn: torch.nn.Module, cls: type, manager: AttentionManager | Any) -> None:
    heads = int(attn.heads)
    # An AttentionRouter runs the model under several SP sizes: the heads must divide by each of them.
    for world_size in getattr(manager, "world_sizes", (manager.world_size,)):
        if heads % world_size:
            raise ValueError(f"heads ({heads}) must be divisible by world_size ({world_size})")
    if isinstance(attn.attention_function, All2AllAttention | AudioAll2AllAttention):
        return  # already patched (a module op applied twice must not nest exchanges)
    attn.attention_function = cls(manager, attn.attention_function)
    # Newer ltx-core splits the masked call into its own slot; patch it too so no call bypasses SP.
    if hasattr(attn, "masked_attention_function"):
        attn.masked_attention_function = cls(manager, attn.masked_attention_function)


def patch_sp_attention(model: torch.nn.Module, manager: AttentionManager | Any) -> torch.nn.Module:
    """Route every block's `attn1` and `video_to_audio_attn` through the all2all callables (in place).

    `manager` is an `AttentionManager` or an `AttentionRouter` (the callables then follow its active layout).

    Raises `ValueError` (on every rank alike, before any collective) when a patched attention's head
    count does not divide by the world size.
    """
    blocks = getattr(model, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"expected an LTXModel with transformer_blocks, got {type(model).__name__}")
    for block in blocks:
        if hasattr(block, "attn1"):
            _patch(block.attn1, All2AllAttention, manager)
        if hasattr(block, "video_to_audio_attn"):
            _patch(block.video_to_audio_attn, AudioAll2AllAttention, manager)
    return model


def create_sp_module_ops(manager: AttentionManager | Any) -> Any:
    """The `ModuleOps` that patches an `LTXModel` for SP (applied by ltx-core to the meta model)."""
    from ltx_core.loader.module_ops import ModuleOps
    from ltx_core.model.transformer.model import LTXModel

    return ModuleOps(
        name=SP_MODULE_OPS_NAME,
        matcher=lambda module: isinstance(module, LTXModel),
        mutator=lambda module: patch_sp_attention(module, manager),
    )


class SequenceParallelBuilder:
    """Builds `SequenceParallelModelWrapper(model)` from a `SingleGPUModelBuilder`.

    Args:
        inner: the single-device builder (checkpoint, sd ops, module ops, LoRAs are all kept).
        attn_mgr: the `AttentionManager` of the transformer group, or an `AttentionRouter` over the groups of
            several layouts; its device is the default build device.
        registry: optional ltx-core state-dict registry to rebind the inner builder to (one per process
            lets several builders share loaded checkpoints).
        sync_audio: broadcast rank 0's audio output each forward (see `SequenceParallelModelWrapper`).
    """

    def __init__(
        self,
        inner: Any,
        attn_mgr: AttentionManager | Any,
        *,
        registry: Any = None,
        sync_audio: bool = True,
    ) -> None:
        from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

        if not isinstance(inner, SingleGPUModelBuilder):
            raise TypeError(f"SequenceParallelBuilder wraps a SingleGPUModelBuilder, got {type(inner).__name__}")
        if registry is not None:
            inner = dataclasses.replace(inner, registry=registry)
        self._plain = inner
        self.attn_mgr = attn_mgr
        self.sync_audio = sync_audio
        ops = tuple(op for op in inner.module_ops if op.name != SP_MODULE_OPS_NAME)
        self.inner = dataclasses.replace(inner, module_ops=(*ops, create_sp_module_ops(attn_mgr)))

    # ---- what the inner builder says -----------------------------------------------------------------
    @property
    def model_path(self) -> str | tuple[str, ...]:
        return self.inner.model_path

    @property
    def loras(self) -> tuple[Any, ...]:
        return self.inner.loras

    @property
    def module_ops(self) -> tuple[Any, ...]:
        return self.inner.module_ops

    @property
    def registry(self) -> Any:
        return self.inner.registry

    def model_config(self) -> dict:
        return self.inner.model_config()

    @property
    def all2all_timeout_seconds(self) -> float:
        """The exchange barrier timeout of the attention manager (raise it around a first compiled
        forward, then set it back)."""
        return self.attn_mgr.all2all_timeout_seconds

    @all2all_timeout_seconds.setter
    def all2all_timeout_seconds(self, seconds: float) -> None:
        self.attn_mgr.all2all_timeout_seconds = seconds

    # ---- functional updates (return a new SP builder around an updated inner builder) ---------------
    def _rewrap(self, inner: Any) -> SequenceParallelBuilder:
        return SequenceParallelBuilder(inner, self.attn_mgr, sync_audio=self.sync_audio)

    def lora(self, lora_path: str, strength: float = 1.0, sd_ops: Any = None) -> SequenceParallelBuilder:
        return self._rewrap(self._plain.lora(lora_path, strength, sd_ops))

    def with_module_ops(self, module_ops: tuple[Any, ...]) -> SequenceParallelBuilder:
        """Append ops after the SP patch (e.g. quantization); the SP op stays first among them."""
        return self._rewrap(dataclasses.replace(self._plain, module_ops=(*self._plain.module_ops, *module_ops)))

    def with_registry(self, registry: Any) -> SequenceParallelBuilder:
        return self._rewrap(dataclasses.replace(self._plain, registry=registry))

    # ---- build ---------------------------------------------------------------------------------------
    def build(
        self, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> SequenceParallelModelWrapper:
        """Build on this rank's device (default: the attention manager's device, never `cuda:{rank}`)."""
        device = self.attn_mgr.device if device is None else torch.device(device)
        model = self.inner.build(device=device, dtype=dtype)
        meta = [name for name, p in model.named_parameters() if p.is_meta]
        meta += [name for name, b in model.named_buffers() if b.is_meta]
        if meta:  # ltx-core loads with strict=False and returns a meta model when keys are missing
            raise RuntimeError(
                f"checkpoint {self.inner.model_path!r} lacks {len(meta)} tensors (first: {meta[:3]}); "
                "the model would still be on the meta device"
            )
        return SequenceParallelModelWrapper(model.eval(), self.attn_mgr, sync_audio=self.sync_audio)
