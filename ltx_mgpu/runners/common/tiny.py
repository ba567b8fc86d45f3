"""Tiny LTX-2 component configs shared by the smoke model and the tiny LTX-2 checkpoints.

The real ltx-core architectures at a size that renders in seconds on CPU ranks, with LTX-2's geometry kept
where the pipeline depends on it: x32 space / x8 time in the video VAE, 128 audio latent channels.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tiny_transformer_config", "tiny_video_decoder_config"]


def tiny_transformer_config(
    *,
    num_layers: int = 2,
    num_heads: int = 24,
    head_dim: int = 8,
    audio_num_heads: int = 24,
    audio_head_dim: int = 4,
    latent_channels: int = 16,
    audio_channels: int = 128,
    caption_channels: int = 32,
) -> dict[str, Any]:
    """A complete `LTXModelConfigurator` config (every checked key present) at a tiny size.

    Defaults: 24 video heads and 24 audio heads, so every world size in {1, 2, 3, 4, 6, 8, 12, 24}
    divides them; 128 audio channels = LTX-2's audio latent (8 channels x 16 mel bins), so the real audio
    decoder geometry (`common.audio.TINY_AUDIO`) decodes it. `cross_attention_dim` must equal the video
    inner dim and `audio_cross_attention_dim` the audio inner dim (ltx-core views the context with those
    widths).
    """
    inner = num_heads * head_dim
    audio_inner = audio_num_heads * audio_head_dim
    return {
        "transformer": {
            # values ltx-core checks (must be exactly these)
            "dropout": 0.0,
            "attention_bias": True,
            "num_vector_embeds": None,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "use_linear_projection": False,
            "only_cross_attention": False,
            "cross_attention_norm": True,
            "double_self_attention": False,
            "upcast_attention": False,
            "standardization_norm": "rms_norm",
            "norm_elementwise_affine": False,
            "qk_norm": "rms_norm",
            "positional_embedding_type": "rope",
            "use_audio_video_cross_attention": True,
            "share_ff": False,
            "av_cross_ada_norm": True,
            "use_middle_indices_grid": True,
            # sizes
            "num_layers": num_layers,
            "num_attention_heads": num_heads,
            "attention_head_dim": head_dim,
            "in_channels": latent_channels,
            "out_channels": latent_channels,
            "cross_attention_dim": inner,
            "audio_num_attention_heads": audio_num_heads,
            "audio_attention_head_dim": audio_head_dim,
            "audio_in_channels": audio_channels,
            "audio_out_channels": audio_channels,
            "audio_cross_attention_dim": audio_inner,
            "caption_channels": caption_channels,
            "positional_embedding_theta": 10000.0,
            "positional_embedding_max_pos": [20, 2048, 2048],
            "audio_positional_embedding_max_pos": [20],
            "timestep_scale_multiplier": 1000,
            "av_ca_timestep_scale_multiplier": 1,
            "rope_type": "interleaved",
            "attention_type": "pytorch",
            "norm_eps": 1e-6,
        }
    }


def tiny_video_decoder_config(*, latent_channels: int = 16, base_channels: int = 4) -> dict[str, Any]:
    """A `VideoDecoderConfigurator` config with LTX-2's scale factors (x32 space, x8 time) at tiny width.

    Three `compress_all` blocks (x2 in time and space each) and a final 4x4 unpatchify give the real
    decoder's geometry: latent (C, F', H', W') -> frames (3, 8(F'-1)+1, 32H', 32W'). Pixel norm (no
    group-count constraints), no timestep conditioning (no injected noise: deterministic decode).
    """
    return {
        "vae": {
            "dims": 3,
            "latent_channels": latent_channels,
            "out_channels": 3,
            "patch_size": 4,
            "norm_layer": "pixel_norm",
            "causal_decoder": False,
            "timestep_conditioning": False,
            "spatial_padding_mode": "reflect",
            "decoder_base_channels": base_channels,
            "decoder_blocks": [
                ["res_x", {"num_layers": 1}],
                ["compress_all", {"multiplier": 2}],
                ["res_x", {"num_layers": 1}],
                ["compress_all", {"multiplier": 2}],
                ["res_x", {"num_layers": 1}],
                ["compress_all", {"multiplier": 2}],
                ["res_x", {"num_layers": 1}],
            ],
        }
    }
