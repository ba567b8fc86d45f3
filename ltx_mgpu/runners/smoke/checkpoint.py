"""Deterministic tiny LTX-2 checkpoints (transformer + video VAE decoder) for tests, CI and the demo.

No LTX-2 weights are available here, so the smoke model is the real ltx-core architecture at a tiny size
with seeded random weights, written as safetensors files with the model config in their metadata, exactly
the format `SingleGPUModelBuilder` loads. The same arguments always produce byte-identical files.

`ensure_smoke_checkpoint(cache_dir)` creates the files once per directory; it is safe to call from
several processes at once (each file is written to a temporary name and renamed into place atomically;
the content is deterministic, so whichever writer wins produces the same bytes).
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

__all__ = [
    "SmokeCheckpoint",
    "default_cache_dir",
    "ensure_smoke_checkpoint",
    "tiny_transformer_config",
    "tiny_video_decoder_config",
    "write_transformer_checkpoint",
    "write_video_decoder_checkpoint",
]

_TRANSFORMER_FILE = "transformer.safetensors"
_DECODER_FILE = "video_decoder.safetensors"
FORMAT_VERSION = 1  #: bump when the generated content changes (part of the cache key)


def tiny_transformer_config(
    *,
    num_layers: int = 2,
    num_heads: int = 24,
    head_dim: int = 8,
    audio_num_heads: int = 24,
    audio_head_dim: int = 4,
    latent_channels: int = 16,
    audio_channels: int = 32,
    caption_channels: int = 32,
) -> dict[str, Any]:
    """A complete `LTXModelConfigurator` config (every checked key present) at a tiny size.

    Defaults: 24 video heads and 24 audio heads, so every world size in {1, 2, 3, 4, 6, 8, 12, 24}
    divides them. `cross_attention_dim` must equal the video inner dim and `audio_cross_attention_dim`
    the audio inner dim (ltx-core views the context with those widths).
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


def _init_(module: torch.nn.Module, seed: int, *, skip: tuple[str, ...] = ()) -> None:
    """Seeded init, in parameter-name order, with scales that keep activations O(1): weights ~
    N(0, 1/fan_in), everything else N(0, 0.1^2). Meta tensors (ltx-core builds the caption projection on
    meta) are materialised on the CPU first."""
    gen = torch.Generator().manual_seed(seed)
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        module.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if any(name.endswith(s) for s in skip):
                continue
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _atomic_save(tensors: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            tmp,
            metadata={"config": json.dumps(config, sort_keys=True)},
        )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared by every rank and fleet
        os.replace(tmp, path)  # atomic: readers see no file or the whole file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_transformer_checkpoint(path: str | Path, config: dict[str, Any], *, seed: int = 0) -> Path:
    """Build the ltx-core AV transformer from `config`, init it from `seed`, save it to `path`."""
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    model = LTXModelConfigurator.from_config(config)
    _init_(model, seed)
    path = Path(path)
    _atomic_save(dict(model.state_dict()), config, path)
    return path


def write_video_decoder_checkpoint(path: str | Path, config: dict[str, Any], *, seed: int = 1) -> Path:
    """Build the ltx-core video VAE decoder from `config`, init it from `seed`, save it to `path`.

    Per-channel latent statistics are set to mean 0 / std 1 (the identity), so the decoder sees the
    latent as generated.
    """
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator

    decoder = VideoDecoderConfigurator.from_config(config)
    _init_(decoder, seed)
    sd = dict(decoder.state_dict())
    for key, value in list(sd.items()):
        if key.startswith("per_channel_statistics."):
            sd[key] = torch.ones_like(value) if "std" in key else torch.zeros_like(value)
    _atomic_save(sd, config, Path(path))
    return Path(path)


@dataclass(frozen=True)
class SmokeCheckpoint:
    """Where the smoke model's files are, and the configs they hold."""

    directory: Path
    transformer_path: Path
    decoder_path: Path
    transformer_config: dict[str, Any]
    decoder_config: dict[str, Any]


def default_cache_dir() -> Path:
    """`$LTX_MGPU_CACHE/smoke`, else `~/.cache/ltx-mgpu/smoke`."""
    root = os.environ.get("LTX_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx-mgpu")
    return Path(root) / "smoke"


def _digest(*configs: dict[str, Any], seed: int) -> str:
    blob = json.dumps([FORMAT_VERSION, seed, *configs], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def ensure_smoke_checkpoint(
    cache_dir: str | Path | None = None,
    *,
    transformer_config: dict[str, Any] | None = None,
    decoder_config: dict[str, Any] | None = None,
    seed: int = 0,
) -> SmokeCheckpoint:
    """Create (once) and return the smoke checkpoint under `cache_dir/<config digest>/`.

    The digest of the configs and seed names the subdirectory, so different configs never collide and an
    existing directory is always the right one. Concurrent callers are safe (atomic renames).
    """
    tcfg = transformer_config or tiny_transformer_config()
    dcfg = decoder_config or tiny_video_decoder_config(latent_channels=tcfg["transformer"]["in_channels"])
    if dcfg["vae"]["latent_channels"] != tcfg["transformer"]["in_channels"]:
        raise ValueError("decoder latent_channels must equal the transformer's in_channels")
    directory = Path(cache_dir or default_cache_dir()) / _digest(tcfg, dcfg, seed=seed)
    tpath, dpath = directory / _TRANSFORMER_FILE, directory / _DECODER_FILE
    if not tpath.exists():
        write_transformer_checkpoint(tpath, tcfg, seed=seed)
    if not dpath.exists():
        write_video_decoder_checkpoint(dpath, dcfg, seed=seed + 1)
    return SmokeCheckpoint(directory, tpath, dpath, tcfg, dcfg)
