"""The two checkpoint profiles: `tiny` (tests, CI) and `full` (LTX-2 19B at the published dimensions).

Where the full dimensions come from (see also the package docstring):

- Transformer: ltx-core 1.0.0's `LTXModelConfigurator` defaults, which equal the published 19B config
  (48 layers; video 32 heads x 128, in/out 128, cross-attention 4096; audio 32 heads x 64, in/out 128,
  cross-attention 2048; caption channels 3840 = Gemma 3 12B's width). RoPE "split" with float64
  frequencies and an audio-video cross-attention timestep multiplier of 1000: the values of the released
  file's metadata header as documented by third-party loaders (diffusers' LTX-2 conversion script says the
  same: split RoPE, double precision). Text connectors: ltx-core's defaults (30 heads x 128, 2 layers).
- Video VAE: 128 latent channels, patch 4, pixel norm; encoder res blocks 4/6/6/2/2 between
  space / time / all / all downsamplers doubling the width 128 -> 2048; decoder base 128 (1024 at the
  latent end), four groups of 5 res blocks between three residual x2 depth-to-space upsamplers, no timestep
  conditioning, reflect padding: diffusers' LTX-2 (2.0) VAE config translated into ltx-core's block list.
- Audio VAE decoder and vocoder: `common.audio.LTX2_AUDIO` (diffusers' 2.0 audio VAE config; the released
  header's vocoder section: HiFi-GAN, 1024 channels, x240 to 24 kHz, stereo); stored in float32 as in the
  released file.
- Spatial upsampler x2: ltx-core's `LatentUpsamplerConfigurator` defaults (128 -> 512 mid channels, 4 res
  blocks per stage, 3-D, spatial x2).
- Gemma 3 12B: ltx-core's `GEMMA3_CONFIG_FOR_LTX` (48 layers, width 3840, 16 heads / 8 KV heads x 256,
  MLP 15360, vocabulary 262,208; SigLIP 27 layers x 1152, 896 px, patch 14), which is google/gemma-3-12b-it's
  config.json.
- Distilled LoRA: rank 384 (the published file is "ltx-2-19b-distilled-lora-384"). ASSUMED targets: every
  linear layer inside the 48 transformer blocks (all q/k/v/out projections of the six attentions and both
  feed-forward layers of each stream), ComfyUI keys. That makes 3.7 B LoRA parameters (7.4 GB in bf16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.audio import LTX2_AUDIO, TINY_AUDIO
from ...common.tiny import tiny_transformer_config, tiny_video_decoder_config

__all__ = ["PROFILES", "Profile", "full", "profile", "tiny"]


@dataclass(frozen=True)
class Profile:
    """Everything that differs between checkpoint sizes."""

    name: str
    monolith_config: dict[str, Any]  #: the monolith's metadata config (transformer, vae, audio_vae, vocoder)
    upsampler_config: dict[str, Any]
    gemma_config: dict[str, Any]  #: Gemma 3 config.json (token ids are filled in from the tokenizer)
    lora_rank: int
    dtype: torch.dtype = torch.bfloat16
    audio_dtype: torch.dtype = torch.bfloat16  #: the audio decoder + vocoder tensors in the monolith
    gemma_shard_bytes: int = 5 << 30  #: Hugging Face-style shards of at most this size
    image_size: int = 896  #: Gemma's image processor size
    full_vocab: bool = False  #: tokenizer with the real vocabulary size and special-token ids
    extra_metadata: dict[str, str] = field(default_factory=dict)


def _upsampler(in_channels: int, *, mid_channels: int, blocks: int) -> dict[str, Any]:
    """A x2 spatial latent upsampler config (`LatentUpsamplerConfigurator` keys)."""
    return {
        "in_channels": in_channels,
        "mid_channels": mid_channels,
        "num_blocks_per_stage": blocks,
        "dims": 3,
        "spatial_upsample": True,
        "temporal_upsample": False,
        "spatial_scale": 2.0,
        "rational_resampler": False,
    }


# =========================================================================================================
# tiny
# =========================================================================================================
TINY_LATENT_CHANNELS = 16
TINY_GEMMA_WIDTH = 32
TINY_GEMMA_LAYERS = 3


def _tiny_monolith() -> dict[str, Any]:
    cfg = tiny_transformer_config(latent_channels=TINY_LATENT_CHANNELS, caption_channels=TINY_GEMMA_WIDTH)
    cfg["transformer"].update(
        {  # V1 connectors work at the Gemma width (the transformer's caption projection maps it to inner dims)
            "connector_num_attention_heads": 2,
            "connector_attention_head_dim": TINY_GEMMA_WIDTH // 2,
            "connector_num_layers": 1,
        }
    )
    vae = tiny_video_decoder_config(latent_channels=TINY_LATENT_CHANNELS)["vae"]
    vae.update(
        {
            "in_channels": 3,
            "latent_log_var": "uniform",
            "encoder_blocks": [["compress_all_res", {"multiplier": 2}]] * 3,  # x4 patch * 2^3 = 32, time 2^3 = 8
        }
    )
    cfg["vae"] = vae
    cfg.update(TINY_AUDIO)
    # Only tiny checkpoints need this: the real feature extractor's Gemma width and depth are ltx-core constants.
    cfg["gemma_text_config"] = {"hidden_size": TINY_GEMMA_WIDTH, "num_hidden_layers": TINY_GEMMA_LAYERS}
    return cfg


def _tiny_gemma() -> dict[str, Any]:
    """A Gemma 3 config.json in the released (transformers 4.5x) format, which transformers 5 also reads."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "mm_tokens_per_image": 16,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": TINY_GEMMA_WIDTH,
            "intermediate_size": 2 * TINY_GEMMA_WIDTH,
            "num_hidden_layers": TINY_GEMMA_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 64,
            "sliding_window_pattern": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
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


@functools.cache
def tiny() -> Profile:
    return Profile(
        name="tiny",
        monolith_config=_tiny_monolith(),
        upsampler_config=_upsampler(TINY_LATENT_CHANNELS, mid_channels=32, blocks=1),
        gemma_config=_tiny_gemma(),
        lora_rank=4,
        image_size=32,
    )


# =========================================================================================================
# full (LTX-2 19B)
# =========================================================================================================
def _full_monolith() -> dict[str, Any]:
    transformer = tiny_transformer_config()["transformer"]  # the checked constants; sizes replaced below
    transformer.update(
        {
            "num_layers": 48,
            "num_attention_heads": 32,
            "attention_head_dim": 128,
            "in_channels": 128,
            "out_channels": 128,
            "cross_attention_dim": 4096,
            "audio_num_attention_heads": 32,
            "audio_attention_head_dim": 64,
            "audio_in_channels": 128,
            "audio_out_channels": 128,
            "audio_cross_attention_dim": 2048,
            "caption_channels": 3840,
            "positional_embedding_theta": 10000.0,
            "positional_embedding_max_pos": [20, 2048, 2048],
            "audio_positional_embedding_max_pos": [20],
            "timestep_scale_multiplier": 1000,
            "av_ca_timestep_scale_multiplier": 1000.0,
            "rope_type": "split",
            "frequencies_precision": "float64",
            "attention_type": "default",
            "connector_num_attention_heads": 30,
            "connector_attention_head_dim": 128,
            "connector_num_layers": 2,
        }
    )
    res = "res_x"
    up = ["compress_all", {"residual": True, "multiplier": 2}]
    vae = {
        "dims": 3,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 128,
        "patch_size": 4,
        "norm_layer": "pixel_norm",
        "latent_log_var": "uniform",
        "causal_decoder": False,
        "timestep_conditioning": False,
        "spatial_padding_mode": "reflect",
        "decoder_base_channels": 128,
        "encoder_blocks": [
            [res, {"num_layers": 4}],
            ["compress_space_res", {"multiplier": 2}],
            [res, {"num_layers": 6}],
            ["compress_time_res", {"multiplier": 2}],
            [res, {"num_layers": 6}],
            ["compress_all_res", {"multiplier": 2}],
            [res, {"num_layers": 2}],
            ["compress_all_res", {"multiplier": 2}],
            [res, {"num_layers": 2}],
        ],
        "decoder_blocks": [
            [res, {"num_layers": 5}],
            up,
            [res, {"num_layers": 5}],
            up,
            [res, {"num_layers": 5}],
            up,
            [res, {"num_layers": 5}],
        ],
    }
    return {"transformer": transformer, "vae": vae, **LTX2_AUDIO}


def _full_gemma() -> dict[str, Any]:
    from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX

    return GEMMA3_CONFIG_FOR_LTX.to_dict()


@functools.cache
def full() -> Profile:
    return Profile(
        name="full",
        monolith_config=_full_monolith(),
        upsampler_config=_upsampler(128, mid_channels=512, blocks=4),
        gemma_config=_full_gemma(),
        lora_rank=384,
        audio_dtype=torch.float32,
        full_vocab=True,
    )


PROFILES = {"tiny": tiny, "full": full}


def profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; expected one of {sorted(PROFILES)}")
    return PROFILES[name]()
