"""Deterministic tiny LTX-2 checkpoints in the *real* on-disk layouts, for tests, CI and GPU smoke runs.

No LTX-2 weights can be downloaded here, so every component is the real architecture at a tiny size with
seeded random weights, written exactly the way the released files are laid out:

- `ltx2.safetensors` ("monolith"): the AV transformer under `model.diffusion_model.`, the video VAE under
  `vae.encoder.` / `vae.decoder.` / `vae.per_channel_statistics.`, the text feature extractor under
  `text_embedding_projection.` and the embeddings connectors under
  `model.diffusion_model.{video,audio}_embeddings_connector.`; the config in the safetensors metadata
  (`transformer`, `vae`, plus `gemma_text_config`, which only tiny checkpoints need: the real feature
  extractor's Gemma width is ltx-core's constant). No audio VAE / vocoder: ltx-core's audio code needs
  torchaudio, which this install route does not have.
- `upsampler.safetensors`: the latent spatial upsampler (x2), its config in the metadata.
- `distilled_lora.safetensors`: a ComfyUI-style LoRA (`diffusion_model.` prefix) over part of the
  transformer's linear weights, standing in for the distilled LoRA.
- `gemma/`: a Hugging Face-style Gemma 3 root: `config.json`, `model-00001-of-00001.safetensors` with the
  transformers 4.5x key layout the released Gemma uses, and a tokenizer built locally (byte-level BPE
  trained in-process on a small fixed corpus) with a chat template, so prompt enhancement runs too.

Files are written to temporary names and renamed (concurrent writers are safe); the directory name is a
digest of the generator version and seed, so an existing directory always holds the right files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TinyLtx2", "ensure_tiny_ltx2", "tiny_ltx2_config"]

FORMAT_VERSION = 1
LATENT_CHANNELS = 16
GEMMA_WIDTH = 32
GEMMA_LAYERS = 3

_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
_CORPUS = [
    "a cat walks along the beach at sunset while waves roll in",
    "the camera slowly pans across a neon city street at night in the rain",
    "a red sports car drives fast on a mountain road, engine roaring",
    "close up of a woman smiling, soft window light, shallow depth of field",
    "an astronaut floats inside a space station, cables drifting",
    "birds fly over a misty lake in the early morning, quiet ambience",
    "a chef chops vegetables in a busy kitchen, steam rising from pans",
    "a dog runs through tall grass towards the camera, wind blowing",
]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tiny_ltx2_config() -> dict[str, Any]:
    """The monolith's metadata config: smoke transformer sizes + V1 connectors + encoder/decoder VAE."""
    from ..smoke.checkpoint import tiny_transformer_config, tiny_video_decoder_config

    cfg = tiny_transformer_config(latent_channels=LATENT_CHANNELS, caption_channels=GEMMA_WIDTH)
    cfg["transformer"].update(
        {  # V1 connectors work at the Gemma width (the transformer's caption projection maps it to inner dims)
            "connector_num_attention_heads": 2,
            "connector_attention_head_dim": GEMMA_WIDTH // 2,
            "connector_num_layers": 1,
        }
    )
    vae = tiny_video_decoder_config(latent_channels=LATENT_CHANNELS)["vae"]
    vae.update(
        {
            "in_channels": 3,
            "latent_log_var": "uniform",
            "encoder_blocks": [["compress_all_res", {"multiplier": 2}]] * 3,  # x4 patch * 2^3 = 32, time 2^3 = 8
        }
    )
    cfg["vae"] = vae
    cfg["gemma_text_config"] = {"hidden_size": GEMMA_WIDTH, "num_hidden_layers": GEMMA_LAYERS}
    return cfg


def tiny_upsampler_config() -> dict[str, Any]:
    return {
        "in_channels": LATENT_CHANNELS,
        "mid_channels": 32,
        "num_blocks_per_stage": 1,
        "dims": 3,
        "spatial_upsample": True,
        "temporal_upsample": False,
        "spatial_scale": 2.0,
        "rational_resampler": False,
    }


def tiny_gemma_config(vocab_size: int, token_ids: dict[str, int]) -> dict[str, Any]:
    """A Gemma 3 config.json in the released (transformers 4.5x) format, which transformers 5 also reads."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": token_ids["<start_of_image>"],
        "eoi_token_index": token_ids["<end_of_image>"],
        "image_token_index": token_ids["<image_soft_token>"],
        "mm_tokens_per_image": 16,
        "bos_token_id": token_ids["<bos>"],
        "eos_token_id": [token_ids["<eos>"], token_ids["<end_of_turn>"]],
        "pad_token_id": token_ids["<pad>"],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": GEMMA_WIDTH,
            "intermediate_size": 2 * GEMMA_WIDTH,
            "num_hidden_layers": GEMMA_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "vocab_size": vocab_size,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 64,
            "sliding_window_pattern": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "bos_token_id": token_ids["<bos>"],
            "eos_token_id": token_ids["<eos>"],
            "pad_token_id": token_ids["<pad>"],
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
            "num_channels": 3,
            "vision_use_head": False,
        },
    }


# =========================================================================================================
# Writing
# =========================================================================================================


def _seeded_init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in), other parameters ~ N(0, 0.1^2), in name order; meta tensors materialised."""
    gen = torch.Generator().manual_seed(seed)
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        module.to_empty(device="cpu")
    with torch.no_grad():
        for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            scale = p[0].numel() ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module


def _atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save(tensors: dict[str, torch.Tensor], path: Path, config: dict[str, Any] | None, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    data = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"config": json.dumps(config, sort_keys=True)} if config is not None else {"format": "pt"}
    _atomic(path, lambda tmp: save_file(data, tmp, metadata=meta))


def write_monolith(path: Path, *, seed: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator, VideoEncoderConfigurator

    from .text import EmbeddingsProcessorFromConfig

    cfg = tiny_ltx2_config()
    sd: dict[str, torch.Tensor] = {}
    transformer = _seeded_init(LTXModelConfigurator.from_config(cfg), seed)
    sd.update({f"model.diffusion_model.{k}": v for k, v in transformer.state_dict().items()})
    for name, configurator, salt in (
        ("decoder", VideoDecoderConfigurator, 1),
        ("encoder", VideoEncoderConfigurator, 2),
    ):
        part = _seeded_init(configurator.from_config(cfg), seed + salt)
        for key, value in part.state_dict().items():
            if key.startswith("per_channel_statistics."):
                stat = torch.ones_like(value) if "std" in key else torch.zeros_like(value)
                sd[f"vae.{key}"] = stat  # identity statistics, shared by encoder and decoder
            else:
                sd[f"vae.{name}.{key}"] = value
    processor = _seeded_init(EmbeddingsProcessorFromConfig.from_config(cfg), seed + 3)
    for key, value in processor.state_dict().items():
        if key.startswith("feature_extractor."):
            sd[f"text_embedding_projection.{key[len('feature_extractor.') :]}"] = value
        elif key.startswith("video_connector."):
            sd[f"model.diffusion_model.video_embeddings_connector.{key[len('video_connector.') :]}"] = value
        elif key.startswith("audio_connector."):
            sd[f"model.diffusion_model.audio_embeddings_connector.{key[len('audio_connector.') :]}"] = value
    _save(sd, path, cfg, dtype)
    return path


def write_upsampler(path: Path, *, seed: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    cfg = tiny_upsampler_config()
    model = _seeded_init(LatentUpsamplerConfigurator.from_config(cfg), seed)
    _save(dict(model.state_dict()), path, cfg, dtype)
    return path


def write_lora(path: Path, monolith: Path, *, seed: int, rank: int = 4, every: int = 2) -> Path:
    """LoRA A/B pairs for every `every`-th 2-D transformer-block weight (ComfyUI key names)."""
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(monolith), framework="pt") as f:
        names = sorted(
            k
            for k in f.keys()
            if k.startswith("model.diffusion_model.transformer_blocks.")
            and k.endswith(".weight")
            and len(f.get_slice(k).get_shape()) == 2
        )
        for i, name in enumerate(names):
            if i % every:
                continue
            rows, cols = f.get_slice(name).get_shape()
            prefix = "diffusion_model." + name[len("model.diffusion_model.") : -len(".weight")]
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) * 0.2
            out[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.2
    _save(out, path, None, torch.bfloat16)
    return path


def write_gemma_root(root: Path, *, seed: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    ids = {t: tok.token_to_id(t) for t in _SPECIAL_TOKENS}
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ids["<bos>"])])
    _atomic(root / "tokenizer.json", tok.save)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "chat_template": _CHAT_TEMPLATE,
        "padding_side": "left",
        "model_max_length": 4096,
    }
    _write_json(root / "tokenizer_config.json", tok_cfg)
    _write_json(
        root / "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "do_resize": True,
            "size": {"height": 32, "width": 32},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "resample": 2,
        },
    )
    cfg = tiny_gemma_config(tok.get_vocab_size(), ids)
    _write_json(root / "config.json", cfg)
    model = _seeded_init(Gemma3ForConditionalGeneration(Gemma3Config.from_dict(cfg)), seed)
    released: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():  # the released (transformers 4.5x) key layout
        if key != "lm_head.weight":  # tied to the token embedding
            released[_released_gemma_key(key)] = value
    _save(released, root / "model-00001-of-00001.safetensors", None, dtype)
    return root


def _released_gemma_key(key: str) -> str:
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


def _write_json(path: Path, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    _atomic(path, write)


@dataclass(frozen=True)
class TinyLtx2:
    """Paths of a tiny LTX-2 checkpoint set (the same setup kwargs a real deployment passes)."""

    directory: Path
    checkpoint: Path  #: the monolith (transformer + VAE + text projection/connectors)
    upsampler: Path
    distilled_lora: Path
    gemma_root: Path

    def setup_kwargs(self) -> dict[str, str]:
        return {
            "checkpoint_path": str(self.checkpoint),
            "spatial_upsampler_path": str(self.upsampler),
            "gemma_root": str(self.gemma_root),
            "distilled_lora_path": str(self.distilled_lora),
        }


def default_cache_dir() -> Path:
    root = os.environ.get("LTX_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx-mgpu")
    return Path(root) / "tiny-ltx2"


def ensure_tiny_ltx2(cache_dir: str | Path | None = None, *, seed: int = 0) -> TinyLtx2:
    """Create (once) and return the tiny LTX-2 files under `cache_dir/<digest>/`; safe to race."""
    # The generator's own source is part of the key: editing it can never leave stale files in a cache.
    sources = [Path(__file__).read_bytes(), (Path(__file__).parent / "text.py").read_bytes()]
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, seed, tiny_ltx2_config()], sort_keys=True).encode())
    for blob in sources:
        digest.update(blob)
    directory = Path(cache_dir or default_cache_dir()) / digest.hexdigest()[:12]
    paths = TinyLtx2(
        directory,
        directory / "ltx2.safetensors",
        directory / "upsampler.safetensors",
        directory / "distilled_lora.safetensors",
        directory / "gemma",
    )
    if not paths.checkpoint.exists():
        write_monolith(paths.checkpoint, seed=seed)
    if not paths.upsampler.exists():
        write_upsampler(paths.upsampler, seed=seed + 10)
    if not paths.distilled_lora.exists():
        write_lora(paths.distilled_lora, paths.checkpoint, seed=seed + 20)
    if not (paths.gemma_root / "model-00001-of-00001.safetensors").exists():
        write_gemma_root(paths.gemma_root, seed=seed + 30)
    return paths
