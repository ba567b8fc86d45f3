"""Audio decoding: the LTX-2 audio VAE decoder and vocoder from ltx-core, with or without torchaudio.

In ltx-core 1.0.0 only the audio *encoder* needs torchaudio (`MelSpectrogram` and `resample` in
`ltx_core/model/audio_vae/ops.py`); the decoder and the vocoder are plain torch. They fail to import on a
machine without a working torchaudio only because the package `ltx_core.model.audio_vae` imports `ops.py`,
which imports torchaudio at module level. `import_audio_vae()` therefore:

- imports the real torchaudio when it imports (GPU hosts ship one): nothing changes;
- otherwise (missing, or a CUDA wheel that fails with `OSError` next to CPU torch) puts a stand-in module
  under `sys.modules["torchaudio"]` for the duration of that one import and restores the previous entry
  right after, so nothing else (transformers checks for torchaudio too) ever sees it. `ops.py` keeps its
  reference to the stand-in; using it (the audio encoder) raises an `ImportError` that says why.

`audio_config(...)` / `audio_specs(config)` describe the two models' checkpoint layout for the generators of
test and benchmark checkpoints (`TINY_AUDIO` for the smoke and tiny sets, `LTX2_AUDIO` at the published
size).

Both models are built from the LTX-2 monolith (or any file in its layout: `audio_vae.decoder.*`,
`audio_vae.per_channel_statistics.*`, `vocoder.*`, config under `audio_vae` and `vocoder` in the metadata)
with ltx-core's own key filters, and checked like every other component (`build_checked`). They run on the
driver rank only.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any

import torch

from ...media.mp4 import AudioTrack
from .loading import build_checked, file_builder
from .weights import TensorSpec, module_specs

__all__ = [
    "LTX2_AUDIO",
    "TINY_AUDIO",
    "AudioDecoding",
    "audio_config",
    "audio_decoder_builder",
    "audio_specs",
    "build_audio_decoding",
    "import_audio_vae",
    "vocoder_builder",
]

_AUDIO_VAE = "ltx_core.model.audio_vae"
_IMPORT_LOCK = threading.Lock()
_MISSING = object()


def _stand_in(reason: str) -> types.ModuleType:
    """A module named torchaudio whose every attribute raises an `ImportError` carrying `reason`."""
    module = types.ModuleType("torchaudio", "stand-in for an unavailable torchaudio (audio decoding only)")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def __getattr__(name: str) -> Any:
        raise ImportError(
            f"torchaudio.{name} is unavailable here ({reason}); the LTX-2 audio decoder and vocoder work without "
            "it, the audio encoder does not"
        )

    module.__getattr__ = __getattr__  # type: ignore[method-assign]  # PEP 562: module-level __getattr__
    return module


def import_audio_vae() -> types.ModuleType:
    """`ltx_core.model.audio_vae`, importable whether or not torchaudio works (see the module docstring)."""
    if _AUDIO_VAE in sys.modules:
        return sys.modules[_AUDIO_VAE]
    with _IMPORT_LOCK:
        if _AUDIO_VAE in sys.modules:
            return sys.modules[_AUDIO_VAE]
        try:
            import torchaudio  # noqa: F401
        except (ImportError, OSError) as exc:  # missing, blocked, or a wheel built for another torch
            reason = f"{type(exc).__name__}: {exc}"
        else:
            return importlib.import_module(_AUDIO_VAE)
        previous = sys.modules.get("torchaudio", _MISSING)
        sys.modules["torchaudio"] = _stand_in(reason)
        try:
            return importlib.import_module(_AUDIO_VAE)
        finally:
            if previous is _MISSING:
                sys.modules.pop("torchaudio", None)
            else:
                sys.modules["torchaudio"] = previous  # e.g. None: a caller's explicit block stays in place


def _builder(configurator: str, sd_ops: str, checkpoint: str, what: str, registry: Any) -> Any:
    audio_vae = import_audio_vae()
    return file_builder(
        getattr(audio_vae, configurator),
        checkpoint,
        f"LTX-2 checkpoint ({what})",
        sd_ops=getattr(audio_vae, sd_ops),
        registry=registry,
    )


def audio_decoder_builder(checkpoint: str, *, registry: Any = None) -> Any:
    """ltx-core builder for the audio VAE decoder (+ its per-channel statistics) from an LTX-2 file."""
    return _builder(
        "AudioDecoderConfigurator", "AUDIO_VAE_DECODER_COMFY_KEYS_FILTER", checkpoint, "audio decoder", registry
    )


def vocoder_builder(checkpoint: str, *, registry: Any = None) -> Any:
    """ltx-core builder for the vocoder (plain or with bandwidth extension, from the config) of an LTX-2 file."""
    return _builder("VocoderConfigurator", "VOCODER_COMFY_KEYS_FILTER", checkpoint, "vocoder", registry)


@dataclass
class AudioDecoding:
    """Audio latent (B=1, 8, frames, mel_bins) -> stereo waveform on the CPU, at the vocoder's rate."""

    decoder: torch.nn.Module
    vocoder: torch.nn.Module

    @property
    def sample_rate(self) -> int:
        return int(self.vocoder.output_sampling_rate)

    def decode(self, latent: torch.Tensor) -> AudioTrack:
        if latent.dim() != 4 or latent.shape[0] != 1:
            raise ValueError(f"expected one audio latent (1, C, frames, mel_bins), got {tuple(latent.shape)}")
        param = next(self.decoder.parameters())
        with torch.inference_mode():
            mel = self.decoder(latent.to(device=param.device, dtype=param.dtype))
            wave = self.vocoder(mel.to(dtype=next(self.vocoder.parameters()).dtype))
        return AudioTrack(wave[0].float().cpu(), self.sample_rate)


def build_audio_decoding(
    checkpoint: str, device: torch.device, dtype: torch.dtype | None, *, registry: Any = None
) -> AudioDecoding:
    """Both audio models from `checkpoint`, meta-checked, on `device`."""
    decoder = build_checked(audio_decoder_builder(checkpoint, registry=registry), device, dtype, "audio decoder")
    vocoder = build_checked(vocoder_builder(checkpoint, registry=registry), device, dtype, "vocoder")
    return AudioDecoding(decoder, vocoder)


# =========================================================================================================
# Checkpoint layout (for generated checkpoints)
# =========================================================================================================


def audio_config(*, ch_mult: tuple[int, ...], num_res_blocks: int, vocoder_channels: int) -> dict[str, Any]:
    """The monolith metadata entries `audio_vae` and `vocoder` (ltx-core's configurator keys) for LTX-2's
    audio path: 16 kHz mel frames (hop 160, 64 mel bins, causal), 8 latent channels x 16 mel bins (the
    transformer's 128 audio channels), x4 in time and frequency, and a stereo HiFi-GAN vocoder to 24 kHz
    (x240 = 6*5*2*2*2). `ch` stays 128: the decoder's per-channel statistics are sized by it and must match
    the 8 x 16 = 128 patchified latent width."""
    return {
        "audio_vae": {
            "model": {
                "params": {
                    "sampling_rate": 16000,
                    "ddconfig": {
                        "ch": 128,
                        "out_ch": 2,
                        "ch_mult": list(ch_mult),
                        "num_res_blocks": num_res_blocks,
                        "attn_resolutions": [],
                        "resolution": 256,
                        "z_channels": 8,
                        "double_z": True,
                        "in_channels": 2,
                        "norm_type": "pixel",
                        "causality_axis": "height",
                        "dropout": 0.0,
                        "mid_block_add_attention": False,
                        "mel_bins": 64,
                    },
                }
            },
            "preprocessing": {
                "stft": {"filter_length": 1024, "hop_length": 160, "causal": True},
                "mel": {"n_mel_channels": 64},
            },
        },
        "vocoder": {
            "resblock": "1",
            "stereo": True,
            "resblock_kernel_sizes": [3, 7, 11],
            "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
            "upsample_rates": [6, 5, 2, 2, 2],
            "upsample_kernel_sizes": [16, 15, 8, 4, 4],
            "upsample_initial_channel": vocoder_channels,
            "output_sampling_rate": 24000,
        },
    }


#: The published LTX-2 (2.0) audio path: decoder ch_mult (1, 2, 4) x 2 res blocks, vocoder 1024 channels.
LTX2_AUDIO = audio_config(ch_mult=(1, 2, 4), num_res_blocks=2, vocoder_channels=1024)
#: The same geometry at test size (one res block per level, 64 vocoder channels): ~0.4 s per second of audio
#: on two CPU cores.
TINY_AUDIO = audio_config(ch_mult=(1, 1, 1), num_res_blocks=1, vocoder_channels=64)


def audio_specs(config: dict[str, Any], dtype: torch.dtype) -> list[TensorSpec]:
    """Plan of the audio decoder and vocoder under their monolith keys (`audio_vae.decoder.*`,
    `audio_vae.per_channel_statistics.*`, `vocoder.*`), read off meta-device models."""
    audio_vae = import_audio_vae()
    with torch.device("meta"):
        decoder = audio_vae.AudioDecoderConfigurator.from_config(config)
        vocoder = audio_vae.VocoderConfigurator.from_config(config)

    def decoder_key(key: str) -> str:
        if key.startswith("per_channel_statistics."):
            return f"audio_vae.{key}"
        return f"audio_vae.decoder.{key}"

    return [
        *module_specs(decoder, dtype=dtype, rename=decoder_key),
        *module_specs(vocoder, dtype=dtype, rename=lambda k: f"vocoder.{k}"),
    ]
