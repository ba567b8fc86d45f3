"""The tensor plan of every synthetic file: keys in the released layouts, shapes, dtypes, fills.

Each component is built on the meta device from its profile config by ltx-core's (or transformers') own
configurator, and its state dict is renamed into the key layout of the released file that the loaders read:

- monolith: `model.diffusion_model.*` (transformer, `video_embeddings_connector.*`,
  `audio_embeddings_connector.*`), `vae.encoder.*`, `vae.decoder.*`, `vae.per_channel_statistics.*`,
  `audio_vae.decoder.*`, `audio_vae.per_channel_statistics.*`, `vocoder.*`, `text_embedding_projection.*`;
- upsampler: the `LatentUpsampler` state dict, config in the metadata;
- distilled LoRA: `diffusion_model.<linear>.lora_A.weight` (rank, in) and `.lora_B.weight` (out, rank), the
  ComfyUI layout;
- Gemma: the transformers 4.5x layout of the released Gemma 3 (`language_model.model.*`,
  `vision_tower.vision_model.*`, `multi_modal_projector.*`; no `lm_head`, it is tied), in Hugging Face shards.

Nothing here allocates tensor memory: a plan is names, shapes and dtypes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.audio import audio_specs
from ...common.weights import TensorSpec, module_specs
from .profiles import Profile

__all__ = [
    "FilePlan",
    "gemma_plans",
    "lora_plan",
    "monolith_plan",
    "released_gemma_key",
    "transformer_meta",
    "upsampler_plan",
]

MONOLITH = "ltx2.safetensors"
UPSAMPLER = "upsampler.safetensors"
LORA = "distilled_lora.safetensors"
GEMMA_DIR = "gemma"
MODEL_VERSION = "2.0"  #: LTX-2.0 defaults in the runners (40 stage-1 steps, STG block 29)


@dataclass(frozen=True)
class FilePlan:
    """One safetensors file: where (relative to the output directory), what, and its metadata."""

    relpath: str
    component: str  #: "monolith" | "upsampler" | "lora" | "gemma"
    specs: list[TensorSpec]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _metadata(profile: Profile, config: dict[str, Any] | None) -> dict[str, str]:
    meta = {"synthetic": "true", "profile": profile.name, **profile.extra_metadata}
    if config is not None:
        meta["config"] = json.dumps(config, sort_keys=True)
    return meta


@functools.cache
def _transformer_meta(name: str) -> torch.nn.Module:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    from .profiles import profile

    with torch.device("meta"):
        return LTXModelConfigurator.from_config(profile(name).monolith_config)


def transformer_meta(profile: Profile) -> torch.nn.Module:
    """The profile's AV transformer on the meta device (built once per profile)."""
    return _transformer_meta(profile.name)


def monolith_plan(profile: Profile) -> FilePlan:
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator, VideoEncoderConfigurator

    from ..gemma_loading import EmbeddingsProcessorFromConfig

    cfg = profile.monolith_config
    with torch.device("meta"):
        decoder = VideoDecoderConfigurator.from_config(cfg)
        encoder = VideoEncoderConfigurator.from_config(cfg)
        processor = EmbeddingsProcessorFromConfig.from_config(cfg)
    dtype = profile.dtype
    specs = module_specs(transformer_meta(profile), dtype=dtype, rename=lambda k: f"model.diffusion_model.{k}")

    def vae_key(part: str) -> Any:
        def rename(key: str) -> str | None:
            if key.startswith("per_channel_statistics."):  # one set, shared by encoder and decoder
                return f"vae.{key}" if part == "decoder" else None
            return f"vae.{part}.{key}"

        return rename

    specs += module_specs(decoder, dtype=dtype, rename=vae_key("decoder"))
    specs += module_specs(encoder, dtype=dtype, rename=vae_key("encoder"))
    specs += audio_specs(cfg, profile.audio_dtype)
    connector = "model.diffusion_model.{}_embeddings_connector."
    prefixes = {
        "feature_extractor.": "text_embedding_projection.",
        "video_connector.": connector.format("video"),
        "audio_connector.": connector.format("audio"),
    }

    def processor_key(key: str) -> str | None:
        for old, new in prefixes.items():
            if key.startswith(old):
                return new + key[len(old) :]
        return None

    specs += module_specs(processor, dtype=dtype, rename=processor_key)
    meta = _metadata(profile, cfg)
    meta["model_version"] = MODEL_VERSION
    return FilePlan(MONOLITH, "monolith", specs, meta)


def upsampler_plan(profile: Profile) -> FilePlan:
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    with torch.device("meta"):
        model = LatentUpsamplerConfigurator.from_config(profile.upsampler_config)
    specs = module_specs(model, dtype=profile.dtype)
    return FilePlan(UPSAMPLER, "upsampler", specs, _metadata(profile, profile.upsampler_config))


def lora_plan(profile: Profile) -> FilePlan:
    """Rank-`profile.lora_rank` A/B pairs for every linear layer in the transformer blocks (see profiles.py for
    what is assumed). Fills: A ~ N(0, 1/in), B ~ N(0, 0.01/rank), so B @ A changes a weight by ~10% of its
    own scale."""
    rank = profile.lora_rank
    specs = []
    for name, module in transformer_meta(profile).named_modules():
        if not (name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear)):
            continue
        out_features, in_features = module.weight.shape
        key = f"diffusion_model.{name}"
        specs.append(
            TensorSpec(f"{key}.lora_A.weight", (rank, in_features), profile.dtype, "normal", in_features**-0.5)
        )
        specs.append(
            TensorSpec(f"{key}.lora_B.weight", (out_features, rank), profile.dtype, "normal", 0.1 * rank**-0.5)
        )
    return FilePlan(LORA, "lora", specs, _metadata(profile, None))


def released_gemma_key(key: str) -> str | None:
    """transformers 5 module key -> the key in the released (transformers 4.5x) Gemma 3 files; None for
    `lm_head.weight` (tied to the token embedding, not stored)."""
    if key == "lm_head.weight":
        return None
    for new, old in (
        ("language_model.model.", "model.language_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if key.startswith(old):
            return new + key[len(old) :]
    if key.startswith("model.vision_tower."):
        rest = key[len("model.vision_tower.") :]
        return "vision_tower." + (rest if rest.startswith("vision_model.") else "vision_model." + rest)
    return key


def gemma_plans(profile: Profile, config: dict[str, Any]) -> list[FilePlan]:
    """Gemma 3 weights for `config` (the config.json written next to them), split into shards of at most
    `profile.gemma_shard_bytes` named like the released ones (`model-0000k-of-0000n.safetensors`)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(Gemma3Config.from_dict(config))
    specs = module_specs(model, dtype=profile.dtype, rename=released_gemma_key, zero_centered_norms=("Gemma3RMSNorm",))
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > profile.gemma_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    n = len(shards)
    meta = {"format": "pt", **_metadata(profile, None)}
    return [
        FilePlan(f"{GEMMA_DIR}/model-{i + 1:05d}-of-{n:05d}.safetensors", "gemma", shard, meta)
        for i, shard in enumerate(shards)
    ]
