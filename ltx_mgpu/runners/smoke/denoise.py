"""The smoke model's text-to-video denoising math, built from ltx-core pieces: latent geometry,
deterministic prompt embeddings, the initial noise, one guided denoising step, the decode to uint8 frames
and the final audio latent.

Pure functions of tensors (no process groups): the runner adds ranks, SP and events around them. The
same functions with the same seed give the same latents on any world size, up to SP's floating-point
reduction order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ...spec.bounds import AUDIO_LATENTS_PER_SECOND, audio_latents

__all__ = [
    "AUDIO_LATENTS_PER_SECOND",
    "PROMPT_TOKENS",
    "SmokeGeometry",
    "audio_latent",
    "build_modalities",
    "decode_frames",
    "denoise_step",
    "initial_states",
    "prompt_embedding",
]

PROMPT_TOKENS = 8  #: length of the hashed "text encoder" output
_AUDIO_LATENT_CHANNELS = 8


@dataclass(frozen=True)
class SmokeGeometry:
    """Latent geometry of one request (LTX-2 VAE factors: x32 in space, x8 in time, first frame apart)."""

    width: int
    height: int
    num_frames: int
    frame_rate: float
    latent_channels: int
    audio_channels: int

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // 8 + 1

    @property
    def latent_height(self) -> int:
        return self.height // 32

    @property
    def latent_width(self) -> int:
        return self.width // 32

    @property
    def video_tokens(self) -> int:
        return self.latent_frames * self.latent_height * self.latent_width

    @property
    def audio_tokens(self) -> int:
        return audio_latents(self.num_frames, self.frame_rate)

    def video_tools(self, batch: int) -> Any:
        from ltx_core.components.patchifiers import VideoLatentPatchifier
        from ltx_core.tools import VideoLatentTools
        from ltx_core.types import VideoLatentShape

        shape = VideoLatentShape(
            batch=batch,
            channels=self.latent_channels,
            frames=self.latent_frames,
            height=self.latent_height,
            width=self.latent_width,
        )
        return VideoLatentTools(VideoLatentPatchifier(patch_size=1), shape, fps=float(self.frame_rate))

    def audio_tools(self, batch: int) -> Any:
        from ltx_core.components.patchifiers import AudioPatchifier
        from ltx_core.tools import AudioLatentTools
        from ltx_core.types import AudioLatentShape

        mel_bins = self.audio_channels // _AUDIO_LATENT_CHANNELS
        shape = AudioLatentShape(
            batch=batch, channels=_AUDIO_LATENT_CHANNELS, frames=self.audio_tokens, mel_bins=mel_bins
        )
        return AudioLatentTools(AudioPatchifier(patch_size=1), shape)


def prompt_embedding(prompt: str, channels: int, *, tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """A deterministic stand-in for the text encoder: (tokens, channels) drawn from a generator seeded
    by the prompt's sha256. Same prompt, same embedding, on every rank and every machine."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "little") & (2**63 - 1)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((tokens, channels), generator=gen)


def initial_states(geometry: SmokeGeometry, seed: int, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Pure-noise video and audio latent states (batch 1), drawn on the CPU from `seed` so every rank
    and every device starts from the same bits, then moved to `device`."""
    from dataclasses import replace

    from ltx_core.components.noisers import GaussianNoiser

    gen = torch.Generator().manual_seed(int(seed))
    noiser = GaussianNoiser(gen)
    states = []
    for tools in (geometry.video_tools(1), geometry.audio_tools(1)):
        state = noiser(tools.create_initial_state("cpu", torch.float32), noise_scale=1.0)
        states.append(
            replace(
                state,
                latent=state.latent.to(device=device, dtype=dtype),
                clean_latent=state.clean_latent.to(device=device, dtype=dtype),
                denoise_mask=state.denoise_mask.to(device),
                positions=state.positions.to(device),
            )
        )
    return states[0], states[1]


def build_modalities(
    video_state: Any,
    audio_state: Any,
    sigma: torch.Tensor,
    context: torch.Tensor,
) -> tuple[Any, Any]:
    """ltx-core `Modality` inputs for one forward; `context` is (B, L, C) and sets the batch size (the
    latent state, batch 1, is repeated: CFG runs conditional and unconditional rows as one batch)."""
    from ltx_core.model.transformer.modality import Modality

    batch = context.shape[0]
    out = []
    for state in (video_state, audio_state):
        latent = state.latent.expand(batch, *state.latent.shape[1:])
        mask = state.denoise_mask.expand(batch, *state.denoise_mask.shape[1:])
        sig = sigma.reshape(1).to(latent.device).expand(batch)
        out.append(
            Modality(
                latent=latent,
                sigma=sig,
                timesteps=mask * sig.view(-1, 1, 1),  # (B, T, 1): X0Model's to_denoised needs the trailing 1
                positions=state.positions.expand(batch, *state.positions.shape[1:]),
                context=context.to(device=latent.device, dtype=latent.dtype),
                context_mask=torch.ones(context.shape[:2], dtype=torch.int64, device=latent.device),
            )
        )
    return out[0], out[1]


def denoise_step(
    x0_model: torch.nn.Module,
    video_state: Any,
    audio_state: Any,
    sigmas: torch.Tensor,
    step: int,
    context: torch.Tensor,
    guidance_scale: float,
) -> tuple[Any, Any]:
    """One Euler step with optional classifier-free guidance (rows: conditional, then unconditional)."""
    from dataclasses import replace

    from ltx_core.components.diffusion_steps import EulerDiffusionStep
    from ltx_core.components.guiders import CFGGuider
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    video, audio = build_modalities(video_state, audio_state, sigmas[step], context)
    with torch.no_grad():
        dv, da = x0_model(video, audio, BatchedPerturbationConfig.empty(context.shape[0]))
    guider = CFGGuider(guidance_scale)
    if context.shape[0] == 2:
        dv = dv[:1] + guider.delta(dv[:1], dv[1:])
        da = da[:1] + guider.delta(da[:1], da[1:])
    euler = EulerDiffusionStep()
    sig = sigmas.to(video_state.latent.device)
    return (
        replace(video_state, latent=euler.step(video_state.latent, dv, sig, step)),
        replace(audio_state, latent=euler.step(audio_state.latent, da, sig, step)),
    )


def decode_frames(decoder: torch.nn.Module, geometry: SmokeGeometry, video_state: Any) -> torch.Tensor:
    """Unpatchify the final video latent and decode it with the ltx-core video VAE decoder:
    uint8 frames (F, H, W, 3) on the decoder's device (converted to yuv420p there: `common.handoff`)."""
    from ltx_core.model.video_vae.video_vae import decode_video

    latent = geometry.video_tools(1).unpatchify(video_state).latent
    dtype = next(decoder.parameters()).dtype
    with torch.no_grad():
        chunks = list(decode_video(latent.to(dtype), decoder))
    return torch.cat(chunks, dim=0)


def audio_latent(geometry: SmokeGeometry, audio_state: Any) -> torch.Tensor:
    """The final audio latent (1, 8, frames, mel_bins) for the audio decoder."""
    return geometry.audio_tools(1).unpatchify(audio_state).latent
