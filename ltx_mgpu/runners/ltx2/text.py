"""LTX-2 prompt encoding on one rank: Gemma 3 (from a Hugging Face-style root directory) + the LTX-2
embeddings processor (feature extractor + connectors, from the LTX-2 checkpoint).

Loaded through ltx-core's `SingleGPUModelBuilder` (safetensors, sd ops, module ops), with three fixes over
ltx-core 1.0.0's own Gemma path, each version-agnostic:
- The Gemma configuration comes from the root's `config.json` (ltx-core hard-codes the 12B config), so a
  tiny test Gemma and the real one load the same way.
- Gemma's non-persistent buffers (rotary frequencies, embedding scale, vision position ids) are rebuilt by
  re-instantiating the modules that own them from their own config; ltx-core's op assumes the
  transformers 4.5x attribute layout (`rotary_emb_local`, `rope_scaling`) and fails on transformers 5.
- The vision tower's key prefix is matched to the installed transformers' module layout.
The tokenizer is found by `tokenizer.json` or `tokenizer.model` anywhere under the root. The image
processor (only needed for image-conditioned prompt enhancement) is optional: it needs pillow and
torchvision; without them `enhance(image=...)` fails clearly and text-only enhancement still works.

`GemmaPromptEncoder` implements `ltx_mgpu.parallel.pipeline.text_encoder.LocalPromptEncoder`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..common.fast_load import StagedSafetensorsLoader
from ..common.host_tier import stream_module
from ..common.loading import check_materialized

__all__ = [
    "EmbeddingsProcessorFromConfig",
    "GemmaPromptEncoder",
    "GemmaRootLoader",
    "GemmaTextEncoderFromConfig",
    "build_gemma_prompt_encoder",
    "build_prompt_encoder",
    "embeddings_processor_builder",
    "gemma_builder",
    "weights_fingerprint",
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


# =========================================================================================================
# The local encoder
# =========================================================================================================


def _clean_enhanced(text: str) -> str:
    """Straighten typographic quotes and dashes and drop leading non-letters (Gemma tends to add them)."""
    table = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "-", "\u2013": "-", "\u00a0": " "}
    text = text.translate(str.maketrans(table))
    for i, ch in enumerate(text):
        if ch.isalpha():
            return text[i:].strip()
    return text.strip()


class GemmaPromptEncoder:
    """Gemma hidden states -> LTX-2 embeddings. Encodings: {"video": (1, T, D), "audio": (1, T, Da) | None,
    "mask": (1, T) int64}.

    Several prompts (CFG's positive and negative) go through Gemma in ONE batched forward: every prompt is
    padded to the same `max_tokens` and Gemma masks the padding, so each row equals its own forward up to
    reduction order (tests/test_text_encoder.py bounds the difference). The embeddings processor then runs
    one prompt at a time, as before: its connectors substitute registers per sequence.

    `identity`: what the encoder's outputs depend on (the weight files, dtype, token count) plus a counter
    that `weights_changed()` bumps; cached embeddings keyed by it are dropped when it changes."""

    def __init__(
        self,
        text_encoder: Any,
        embeddings_processor: Any,
        *,
        enhance_max_new_tokens: int = 512,
        fingerprint: str | None = None,
        device: torch.device | None = None,
        streamed: Any = None,
    ) -> None:
        self.text_encoder = text_encoder
        self.device = device  #: where the inputs go (None: Gemma's first parameter's device)
        self.streamed = streamed  #: the `StreamedLayers` of a `stream`-placed encoder (None: resident)
        self.embeddings_processor = embeddings_processor
        self.enhance_max_new_tokens = int(enhance_max_new_tokens)
        self._fingerprint = fingerprint or f"object-{id(self)}"
        self._version = 0

    @property
    def identity(self) -> str:
        return f"{self._fingerprint}#{self._version}"

    def weights_changed(self) -> None:
        """Call after changing the encoder's weights in place: embeddings cached under the old identity go."""
        self._version += 1

    def encode(self, prompts: Sequence[str]) -> list[dict[str, torch.Tensor | None]]:
        prompts = list(prompts)
        if not prompts:
            return []
        te = self.text_encoder
        device = self.device or te.model.device
        pairs = [te.tokenizer.tokenize_with_weights(p)["gemma"] for p in prompts]
        input_ids = torch.tensor([[t[0] for t in row] for row in pairs], device=device)
        attention_mask = torch.tensor([[t[1] for t in row] for row in pairs], device=device)
        out = []
        with torch.inference_mode():
            hidden = te.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            states = hidden.hidden_states
            del hidden
            for i in range(len(prompts)):
                row = tuple(h[i : i + 1] for h in states)
                video, audio, binary = self.embeddings_processor.process_hidden_states(row, attention_mask[i : i + 1])
                out.append({"video": video, "audio": audio, "mask": binary.to(torch.int64)})
        return out

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str:
        """Rewrite `prompt` with Gemma (sampling, seeded). `image`: uint8 (H, W, 3) tensor or None."""
        te = self.text_encoder
        if image is not None:
            if te.processor is None:
                raise ValueError(
                    "image-conditioned prompt enhancement needs the Gemma image processor, which is unavailable: "
                    f"{te.processor_error}"
                )
            return _clean_enhanced(te.enhance_i2v(prompt, image, max_new_tokens=self.enhance_max_new_tokens, seed=seed))
        tokenizer = te.tokenizer.tokenizer
        messages = [
            {"role": "system", "content": te.default_gemma_t2v_system_prompt},
            {"role": "user", "content": f"user prompt: {prompt}"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        dev = self.device or te.model.device
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(dev)
        with torch.inference_mode(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(int(seed))
            generated = te.model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=self.enhance_max_new_tokens,
                do_sample=True,
                temperature=0.7,
            )
        new_tokens = generated[0][inputs["input_ids"].shape[1] :]
        return _clean_enhanced(tokenizer.decode(new_tokens, skip_special_tokens=True))


def build_gemma_prompt_encoder(
    gemma_root: str | Path,
    checkpoint: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    max_tokens: int = DEFAULT_PROMPT_TOKENS,
    enhance_max_new_tokens: int = 512,
    registry: Any = None,
    stream: bool = False,
) -> GemmaPromptEncoder:
    """Load Gemma and the embeddings processor on `device` (the real loaders, meta-checked). `stream`: Gemma's
    decoder layers stay in pinned host memory and visit `device` one ahead of their use (`StreamedLayers`, the
    `stream` placement tier): Gemma loads into host memory and only the rest of it moves to `device`, so the
    device never holds the whole encoder, not even while loading."""
    device = torch.device(device)
    load_on = torch.device("cpu") if stream else device
    builder = gemma_builder(gemma_root, max_tokens=max_tokens, registry=registry)
    text_encoder = builder.build(device=load_on, dtype=dtype)
    text_encoder = check_materialized(text_encoder, f"Gemma at {gemma_root}")
    streamed = stream_module(text_encoder.model, device) if stream else None
    processor = embeddings_processor_builder(checkpoint, registry=registry).build(device=device, dtype=dtype)
    processor = check_materialized(processor, f"embeddings processor in {checkpoint}")
    fingerprint = weights_fingerprint(
        [*sorted(Path(gemma_root).rglob("*.safetensors")), Path(checkpoint)],
        dtype=str(dtype),
        max_tokens=int(max_tokens),
    )
    return GemmaPromptEncoder(
        text_encoder,
        processor,
        enhance_max_new_tokens=enhance_max_new_tokens,
        fingerprint=fingerprint,
        device=device,
        streamed=streamed,
    )


def weights_fingerprint(files: Sequence[Path], **options: Any) -> str:
    """A short digest of the weight files (path, size, mtime) and `options`: two encoders with the same
    fingerprint produce the same embeddings, so cached ones stay valid (hashing 24 GB would not pay)."""
    import hashlib

    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_prompt_encoder(
    runner: Any,
    mode: str,
    source_rank: int | None,
    *,
    gemma_root: str | Path,
    checkpoint: str,
    dtype: torch.dtype,
    max_tokens: int,
    enhance_max_new_tokens: int,
    stream: bool = False,
) -> Any:
    """The fleet's prompt encoder for `runner`: "source" (Gemma on `source_rank`, embeddings broadcast) or
    "batch-parallel" (Gemma on every rank, prompts split). Checks the options before loading anything.
    `stream`: Gemma's layers streamed from pinned host memory (`build_gemma_prompt_encoder`).

    `source_rank` None: the last rank. The driver (rank 0) already holds the VAE encoder, the upsampler and
    the audio decoder and does the mux; Gemma (24 GB at real size) elsewhere balances both memory and the
    weight load of a cold start (measured on two H200s: rank 0 took 26 s to load with Gemma, rank 1 10 s
    without)."""
    from ...parallel.pipeline.text_encoder import BatchParallelPromptEncoder, DistributedPromptEncoder

    if mode not in ("source", "batch-parallel"):
        raise ValueError(f"text_encoder must be 'source' or 'batch-parallel', got {mode!r}")
    src = runner.world_size - 1 if source_rank is None else int(source_rank)
    if mode == "source" and not 0 <= src < runner.world_size:
        raise ValueError(f"text_encoder_rank {src} is outside the fleet (size {runner.world_size})")

    def local() -> GemmaPromptEncoder:
        return build_gemma_prompt_encoder(
            gemma_root,
            checkpoint,
            device=runner.device,
            dtype=dtype,
            max_tokens=max_tokens,
            enhance_max_new_tokens=enhance_max_new_tokens,
            stream=stream,
        )

    group = runner.groups.gemma_group
    if mode == "batch-parallel":
        return BatchParallelPromptEncoder(local(), group=group, device=runner.device)
    encoder = local() if runner.rank == src else None
    return DistributedPromptEncoder(encoder, group=group, device=runner.device, src_rank=src)
