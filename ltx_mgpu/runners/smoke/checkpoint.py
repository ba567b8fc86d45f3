"""Deterministic tiny LTX-2 checkpoints (transformer, video VAE decoder, audio decoder + vocoder) for tests, CI
and the demo.

No LTX-2 weights are available here, so the smoke model is the real ltx-core architecture at a tiny size
with seeded random weights (`common.weights`), written as safetensors files with the model config in their
metadata, exactly the format `SingleGPUModelBuilder` loads. The audio file uses the monolith's real layout
(`audio_vae.decoder.*`, `audio_vae.per_channel_statistics.*`, `vocoder.*`), so the smoke runner loads it
with the same builders as the LTX-2 runners. The same arguments always produce byte-identical files.

`ensure_smoke_checkpoint(cache_dir)` creates the files once per directory; it is safe to call from
several processes at once (each file is written to a temporary name and renamed into place atomically;
the content is deterministic, so whichever writer wins produces the same bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common.audio import TINY_AUDIO, audio_specs
from ..common.tiny import tiny_transformer_config, tiny_video_decoder_config
from ..common.weights import module_specs, write_safetensors

__all__ = [
    "SmokeCheckpoint",
    "default_cache_dir",
    "ensure_smoke_checkpoint",
    "tiny_transformer_config",
    "tiny_video_decoder_config",
    "write_audio_checkpoint",
    "write_transformer_checkpoint",
    "write_video_decoder_checkpoint",
]

_TRANSFORMER_FILE = "transformer.safetensors"
_DECODER_FILE = "video_decoder.safetensors"
_AUDIO_FILE = "audio.safetensors"
FORMAT_VERSION = 2  #: bump when the generated content changes (part of the cache key); 2: audio, new fills


def _config_meta(config: dict[str, Any]) -> dict[str, str]:
    return {"config": json.dumps(config, sort_keys=True), "synthetic": "true"}


def write_transformer_checkpoint(path: str | Path, config: dict[str, Any], *, seed: int = 0) -> Path:
    """The ltx-core AV transformer of `config`, seeded random weights, at `path` (float32)."""
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    with torch.device("meta"):
        model = LTXModelConfigurator.from_config(config)
    write_safetensors(path, module_specs(model, dtype=torch.float32), seed=seed, metadata=_config_meta(config))
    return Path(path)


def write_video_decoder_checkpoint(path: str | Path, config: dict[str, Any], *, seed: int = 1) -> Path:
    """The ltx-core video VAE decoder of `config` at `path`; its per-channel latent statistics are the
    identity (mean 0, std 1), so the decoder sees the latent as generated."""
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator

    with torch.device("meta"):
        decoder = VideoDecoderConfigurator.from_config(config)
    write_safetensors(path, module_specs(decoder, dtype=torch.float32), seed=seed, metadata=_config_meta(config))
    return Path(path)


def write_audio_checkpoint(path: str | Path, config: dict[str, Any] = TINY_AUDIO, *, seed: int = 2) -> Path:
    """The audio VAE decoder + vocoder of `config` at `path`, in the monolith's key layout."""
    write_safetensors(path, audio_specs(config, torch.float32), seed=seed, metadata=_config_meta(config))
    return Path(path)


@dataclass(frozen=True)
class SmokeCheckpoint:
    """Where the smoke model's files are, and the configs they hold."""

    directory: Path
    transformer_path: Path
    decoder_path: Path
    audio_path: Path  #: audio VAE decoder + vocoder (monolith layout)
    transformer_config: dict[str, Any]
    decoder_config: dict[str, Any]


def default_cache_dir() -> Path:
    """`$LTX_MGPU_CACHE/smoke`, else `~/.cache/ltx-mgpu/smoke`."""
    root = os.environ.get("LTX_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx-mgpu")
    return Path(root) / "smoke"


def _digest(*configs: dict[str, Any], seed: int) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, seed, *configs], sort_keys=True).encode())
    common = Path(__file__).parents[1] / "common"
    for source in (Path(__file__), common / "weights.py", common / "audio.py"):  # a generator edit never
        digest.update(source.read_bytes())  # leaves stale files in a cache
    return digest.hexdigest()[:12]


def ensure_smoke_checkpoint(
    cache_dir: str | Path | None = None,
    *,
    transformer_config: dict[str, Any] | None = None,
    decoder_config: dict[str, Any] | None = None,
    seed: int = 0,
) -> SmokeCheckpoint:
    """Create (once) and return the smoke checkpoint under `cache_dir/<config digest>/`.

    The digest of the configs, the seed and the generator's source names the subdirectory, so different
    configs never collide and an existing directory is always the right one. Concurrent callers are safe
    (atomic renames).
    """
    tcfg = transformer_config or tiny_transformer_config()
    dcfg = decoder_config or tiny_video_decoder_config(latent_channels=tcfg["transformer"]["in_channels"])
    if dcfg["vae"]["latent_channels"] != tcfg["transformer"]["in_channels"]:
        raise ValueError("decoder latent_channels must equal the transformer's in_channels")
    directory = Path(cache_dir or default_cache_dir()) / _digest(tcfg, dcfg, TINY_AUDIO, seed=seed)
    tpath, dpath, apath = directory / _TRANSFORMER_FILE, directory / _DECODER_FILE, directory / _AUDIO_FILE
    if not tpath.exists():
        write_transformer_checkpoint(tpath, tcfg, seed=seed)
    if not dpath.exists():
        write_video_decoder_checkpoint(dpath, dcfg, seed=seed + 1)
    if not apath.exists():
        write_audio_checkpoint(apath, seed=seed + 2)
    return SmokeCheckpoint(directory, tpath, dpath, apath, tcfg, dcfg)
