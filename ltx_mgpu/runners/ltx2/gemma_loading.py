"""How Gemma 3 (from a Hugging Face-style root directory) and the LTX-2 embeddings processor (feature extractor +
connectors, from the LTX-2 checkpoint) load: ltx-core's `SingleGPUModelBuilder` (safetensors, sd ops, module
ops), with three fixes over ltx-core 1.0.0's own Gemma path, each version-agnostic:
- The Gemma configuration comes from the root's `config.json` (ltx-core hard-codes the 12B config), so a
  tiny test Gemma and the real one load the same way.
- Gemma's non-persistent buffers (rotary frequencies, embedding scale, vision position ids) are rebuilt by
  re-instantiating the modules that own them from their own config; ltx-core's op assumes the
  transformers 4.5x attribute layout (`rotary_emb_local`, `rope_scaling`) and fails on transformers 5.
- The vision tower's key prefix is matched to the installed transformers' module layout.
The tokenizer is found by `tokenizer.json` or `tokenizer.model` anywhere under the root. The image
processor (only needed for image-conditioned prompt enhancement) is optional: it needs pillow and
torchvision; without them `enhance(image=...)` fails clearly and text-only enhancement still works.

The encoder built from them is `ltx_mgpu.runners.ltx2.text`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..common.fast_load import StagedSafetensorsLoader

__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "EmbeddingsProcessorFromConfig",
    "GemmaRootLoader",
    "GemmaTextEncoderFromConfig",
    "embeddings_processor_builder",
    "gemma_builder",
    "gemma_module_ops",
    "tie_output_head",
]

DEFAULT_PROMPT_TOKENS = 1024  #: ltx-core pads every prompt to 1024 Gemma tokens


def _find(root: str | Path, *names: str) -> Path | None:
    for name in names:
        hits = sorted(Path(root).rglob(name))
        if hits:
            return hits[0]
    return None


# =========================================================================================================
# Loading Gemma through SingleGPUModelBuilder
# =========================================================================================================


@dataclass(frozen=True)
class GemmaRootLoader:
    """A `StateDictLoader` whose metadata is the Gemma root's `config.json` (HF shards carry no config)."""

    config_path: str
    weight_loader: Any = field(default=None)

    def metadata(self, path: str) -> dict:
        del path
        with open(self.config_path, encoding="utf-8") as f:
            return {"gemma3": json.load(f)}

    def load(self, path: str | list[str], sd_ops: Any = None, device: torch.device | None = None) -> Any:
        from ltx_core.loader.sft_loader import SafetensorsStateDictLoader

        return (self.weight_loader or SafetensorsStateDictLoader()).load(path, sd_ops, device)


class GemmaTextEncoderFromConfig:
    """`ModelConfigurator` for ltx-core's `GemmaTextEncoder` from the root's own Gemma 3 config
    (falls back to ltx-core's built-in 12B config when none is given)."""

    @classmethod
    def from_config(cls, config: dict) -> Any:
        from ltx_core.text_encoders.gemma import GemmaTextEncoder
        from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        raw = config.get("gemma3") or GEMMA3_CONFIG_FOR_LTX.to_dict()
        with torch.device("meta"):
            model = Gemma3ForConditionalGeneration(Gemma3Config.from_dict(raw))
        return GemmaTextEncoder(model=model)


def _rebuild_buffers(module: torch.nn.Module) -> torch.nn.Module:
    """Give every meta non-persistent buffer of Gemma real values (on the CPU; `build` moves them)."""
    for sub in module.modules():
        meta = [n for n, b in sub.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        if type(sub).__name__.endswith("RotaryEmbedding") and hasattr(sub, "config"):
            fresh = type(sub)(sub.config)  # recomputes its frequencies from its own config
            for name, value in fresh.named_buffers(recurse=False):
                sub._buffers[name] = value
            continue
        for name in meta:
            old = sub._buffers[name]
            if name == "embed_scale":
                value = getattr(sub, "scalar_embed_scale", None) or float(sub.embedding_dim) ** 0.5
                sub._buffers[name] = torch.tensor(value, dtype=torch.float32)
            elif name == "position_ids":
                sub._buffers[name] = torch.arange(old.shape[-1], dtype=torch.long).expand(old.shape).clone()
    return module


def gemma_module_ops(gemma_root: str | Path, *, max_tokens: int = DEFAULT_PROMPT_TOKENS) -> tuple[Any, ...]:
    from ltx_core.loader.module_ops import ModuleOps
    from ltx_core.text_encoders.gemma import GemmaTextEncoder
    from ltx_core.text_encoders.gemma.tokenizer import LTXVGemmaTokenizer

    tokenizer_file = _find(gemma_root, "tokenizer.json", "tokenizer.model")
    if tokenizer_file is None:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model under the Gemma root {gemma_root}")
    processor_file = _find(gemma_root, "preprocessor_config.json")

    def load_tokenizer(module: Any) -> Any:
        module.tokenizer = LTXVGemmaTokenizer(str(tokenizer_file.parent), max_tokens)
        return module

    def load_processor(module: Any) -> Any:
        module.processor = None
        module.processor_error = "no preprocessor_config.json under the Gemma root"
        if processor_file is None:
            return module
        try:
            from transformers import AutoImageProcessor, Gemma3Processor

            image_processor = AutoImageProcessor.from_pretrained(str(processor_file.parent), local_files_only=True)
            per_image = int(getattr(module.model.config, "mm_tokens_per_image", 256))
            module.processor = Gemma3Processor(
                image_processor=image_processor, tokenizer=module.tokenizer.tokenizer, image_seq_length=per_image
            )
            module.processor_error = None
        except Exception as exc:  # e.g. pillow / torchvision missing: only image enhancement is affected
            module.processor_error = " ".join(str(exc).split())
        return module

    def is_encoder(module: Any) -> bool:
        return isinstance(module, GemmaTextEncoder)

    return (
        ModuleOps("GemmaBuffers", matcher=is_encoder, mutator=_rebuild_buffers),
        ModuleOps("GemmaTokenizer", matcher=is_encoder, mutator=load_tokenizer),
        ModuleOps("GemmaProcessor", matcher=is_encoder, mutator=load_processor),
    )


def _gemma_sd_ops(meta_keys: set[str]) -> Any:
    """ltx-core's Gemma key ops, plus the vision-tower prefix of transformers 5 (no `.vision_model.`)."""
    from ltx_core.text_encoders.gemma import GEMMA_LLM_KEY_OPS

    if any(k.startswith("model.model.vision_tower.vision_model.") for k in meta_keys):
        return GEMMA_LLM_KEY_OPS
    return GEMMA_LLM_KEY_OPS.with_replacement("model.model.vision_tower.vision_model.", "model.model.vision_tower.")


def gemma_builder(gemma_root: str | Path, *, max_tokens: int = DEFAULT_PROMPT_TOKENS, registry: Any = None) -> Any:
    """A `SingleGPUModelBuilder` for Gemma from a root directory (HF layout: config.json, *.safetensors,
    tokenizer files)."""
    from ltx_core.loader.registry import DummyRegistry
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

    root = Path(gemma_root)
    if not root.is_dir():
        raise FileNotFoundError(f"Gemma root {root} is not a directory")
    config = _find(root, "config.json")
    if config is None:
        raise FileNotFoundError(f"no config.json under the Gemma root {root}")
    first = _find(root, "model*.safetensors")
    if first is None:
        raise FileNotFoundError(f"no model*.safetensors under the Gemma root {root}")
    shards = tuple(str(p) for p in sorted(first.parent.glob("*.safetensors")))
    base = SingleGPUModelBuilder(
        GemmaTextEncoderFromConfig,
        shards,
        module_ops=gemma_module_ops(root, max_tokens=max_tokens),
        model_loader=GemmaRootLoader(str(config), weight_loader=StagedSafetensorsLoader()),
        registry=registry or DummyRegistry(),
    )
    meta_keys = set(base.meta_model(base.model_config(), ()).state_dict().keys())
    from dataclasses import replace

    return replace(base, model_sd_ops=_gemma_sd_ops(meta_keys))


def tie_output_head(gemma: Any) -> None:
    """One Parameter for Gemma's token table and its output head. ltx-core's key ops file the checkpoint's
    table under both names (the head, tied in Gemma 3, is only for enhancement's `generate()`), and the build
    gives each key a Parameter of its own: the same storage where the load keeps the dtype, two copies where it
    casts (a float32 CPU rank: the table twice), and, either way, two weights to every code that places,
    parks or streams parameters one by one. A head with other values (not this checkpoint layout) stays."""
    table, head = gemma.get_input_embeddings(), gemma.get_output_embeddings()
    if head is None or head.weight is table.weight or head.weight.shape != table.weight.shape:
        return
    same = head.weight.data_ptr() == table.weight.data_ptr() and head.weight.stride() == table.weight.stride()
    if same or torch.equal(head.weight, table.weight):
        head.weight = table.weight


# =========================================================================================================
# The LTX-2 embeddings processor (feature extractor + connectors), from the LTX-2 checkpoint
# =========================================================================================================


class EmbeddingsProcessorFromConfig:
    """ltx-core's `EmbeddingsProcessorConfigurator`, except that the Gemma width and depth the feature
    extractor expects can come from the checkpoint config (`gemma_text_config`: hidden_size,
    num_hidden_layers), which only test checkpoints set; real checkpoints take ltx-core's path unchanged."""

    @classmethod
    def from_config(cls, config: dict) -> Any:
        from ltx_core.text_encoders.gemma import EmbeddingsProcessor, EmbeddingsProcessorConfigurator
        from ltx_core.text_encoders.gemma.embeddings_connector import (
            AudioEmbeddings1DConnectorConfigurator,
            Embeddings1DConnectorConfigurator,
        )
        from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2

        dims = config.get("gemma_text_config")
        if not dims:
            return EmbeddingsProcessorConfigurator.from_config(config)
        t = config.get("transformer", {})
        width, layers = int(dims["hidden_size"]), int(dims["num_hidden_layers"]) + 1
        flat = width * layers
        if t.get("caption_proj_before_connector"):  # V2 (22B style): dual aggregate embeds
            video_inner = t["num_attention_heads"] * t["attention_head_dim"]
            audio_inner = t["audio_num_attention_heads"] * t["audio_attention_head_dim"]
            extractor: torch.nn.Module = FeatureExtractorV2(
                video_aggregate_embed=torch.nn.Linear(flat, video_inner, bias=True),
                embedding_dim=width,
                audio_aggregate_embed=torch.nn.Linear(flat, audio_inner, bias=True),
            )
        else:  # V1 (19B style): one aggregate embed back to the Gemma width
            extractor = FeatureExtractorV1(aggregate_embed=torch.nn.Linear(flat, width, bias=False), is_av=True)
        return EmbeddingsProcessor(
            video_connector=Embeddings1DConnectorConfigurator.from_config(config),
            audio_connector=AudioEmbeddings1DConnectorConfigurator.from_config(config),
            feature_extractor=extractor,
        )


def embeddings_processor_builder(checkpoint: str, *, registry: Any = None) -> Any:
    from ltx_core.loader.registry import DummyRegistry
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.text_encoders.gemma import EMBEDDINGS_PROCESSOR_KEY_OPS

    return SingleGPUModelBuilder(
        EmbeddingsProcessorFromConfig,
        checkpoint,
        model_sd_ops=EMBEDDINGS_PROCESSOR_KEY_OPS,
        registry=registry or DummyRegistry(),
    )
