"""The LTX-2 text/image-to-video denoising math shared by the runners, built from ltx-core pieces
(ltx-pipelines 1.0.0 cannot be imported here: it imports the audio VAE, which needs torchaudio, at import
time).

Pure functions of tensors and models (no process groups): the runners add ranks, parallel wrappers,
cancellation and events around them. Facts reused from LTX-2: the stage-1 scheduler (`LTX2Scheduler`),
the distilled sigma schedules, latent geometry (x32 space, x8 time, first frame apart), multi-modal
guidance (CFG + STG + modality isolation + rescale, ltx-core's `MultiModalGuider`), Euler steps, the x2
latent upsampler applied between the encoder's per-channel statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DISTILLED_SIGMAS",
    "STAGE2_DISTILLED_SIGMAS",
    "STAGE2_TDP_SIGMAS",
    "Geometry",
    "GuidanceParams",
    "Pass",
    "blend_clean",
    "build_conditionings",
    "encode_images",
    "guided_denoise",
    "image_latent_shape",
    "make_state",
    "modality",
    "one_for_every_token",
    "run_passes",
    "simple_denoise",
    "upsample_latent",
]

#: The distilled model's 8-step schedule (stage 1 of the distilled pipeline).
DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0)
#: The refinement schedule after the x2 upsampler (stage 2, single device or SP).
STAGE2_DISTILLED_SIGMAS = (0.909375, 0.725, 0.421875, 0.0)
#: A lower first sigma for tiled (TDP) refinement: tiles drift apart more the noisier they start.
STAGE2_TDP_SIGMAS = (0.625, 0.4, 0.0)


@dataclass(frozen=True)
class Geometry:
    """Pixel geometry of a request and the latent grids of its two stages."""

    width: int
    height: int
    num_frames: int
    frame_rate: float
    latent_channels: int
    audio_channels: int = 128  #: the transformer's audio_in_channels = 8 latent channels x mel bins

    def video_tools(self, scale: int = 1) -> Any:
        """ltx-core `VideoLatentTools` at 1/scale of the target resolution."""
        from ltx_core.components.patchifiers import VideoLatentPatchifier
        from ltx_core.tools import VideoLatentTools
        from ltx_core.types import VideoLatentShape, VideoPixelShape

        pixels = VideoPixelShape(1, self.num_frames, self.height // scale, self.width // scale, self.frame_rate)
        shape = VideoLatentShape.from_pixel_shape(pixels, latent_channels=self.latent_channels)
        return VideoLatentTools(VideoLatentPatchifier(patch_size=1), shape, float(self.frame_rate))

    def audio_tools(self) -> Any:
        from ltx_core.components.patchifiers import AudioPatchifier
        from ltx_core.tools import AudioLatentTools
        from ltx_core.types import AudioLatentShape, VideoPixelShape

        pixels = VideoPixelShape(1, self.num_frames, self.height, self.width, self.frame_rate)
        shape = AudioLatentShape.from_video_pixel_shape(pixels, channels=8, mel_bins=self.audio_channels // 8)
        return AudioLatentTools(AudioPatchifier(patch_size=1), shape)

    def tokens(self, scale: int = 1) -> int:
        shape = self.video_tools(scale).target_shape
        return int(shape.frames * shape.height * shape.width)


@dataclass(frozen=True)
class GuidanceParams:
    """Multi-modal guidance for one modality (ltx-core `MultiModalGuiderParams` fields)."""

    cfg_scale: float = 1.0
    stg_scale: float = 0.0
    stg_blocks: tuple[int, ...] = ()
    rescale_scale: float = 0.0
    modality_scale: float = 1.0

    def to_ltx(self) -> Any:
        from ltx_core.components.guiders import MultiModalGuiderParams

        return MultiModalGuiderParams(
            cfg_scale=self.cfg_scale,
            stg_scale=self.stg_scale,
            stg_blocks=list(self.stg_blocks),
            rescale_scale=self.rescale_scale,
            modality_scale=self.modality_scale,
            skip_step=0,
        )


# =========================================================================================================
# States and modalities
# =========================================================================================================


def make_state(
    tools: Any,
    conditionings: Sequence[Any],
    *,
    generator: torch.Generator,
    noise_scale: float,
    device: torch.device,
    dtype: torch.dtype,
    initial_latent: torch.Tensor | None = None,
    frozen: bool = False,
) -> Any:
    """Initial latent state: optional initial latent, conditionings applied, then Gaussian noise scaled by
    `noise_scale * denoise_mask`. Noise is drawn on the CPU from `generator` so every rank and every device
    gets the same bits. `frozen`: denoise mask 0 everywhere (the modality is fixed conditioning)."""
    latent = None if initial_latent is None else initial_latent.to(device=device, dtype=dtype)
    state = tools.create_initial_state(device, dtype, latent)
    for cond in conditionings:
        state = cond.apply_to(latent_state=state, latent_tools=tools)
    if frozen:
        return dataclasses.replace(state, denoise_mask=one_for_every_token(torch.zeros_like(state.denoise_mask)))
    noise = torch.randn(tuple(state.latent.shape), generator=generator, dtype=torch.float32)
    mask = state.denoise_mask.float() * float(noise_scale)
    noisy = noise.to(device) * mask + state.latent.float() * (1.0 - mask)
    # without conditioning items every token is denoised alike (ltx-core's initial mask is all ones); checked,
    # not assumed, at one host sync per state (a stage's), so a mask of another making stays per token
    denoise_mask = state.denoise_mask
    if not conditionings and denoise_mask.dim() >= 2 and bool((denoise_mask == denoise_mask[:, :1]).all()):
        denoise_mask = one_for_every_token(denoise_mask)
    return dataclasses.replace(state, latent=noisy.to(dtype), denoise_mask=denoise_mask)


def one_for_every_token(mask: torch.Tensor) -> torch.Tensor:
    """`mask` (B, T, ...) as its first token's value seen at every token: a view with stride 0 along the tokens,
    for a mask known to be uniform. Every consumer still sees a per-token mask; `modality()` reads the stride
    and gives the transformer one timestep per row instead of one per token.

    Why: ltx-core embeds the timesteps per token and every block expands its AdaLN table over them, so a
    per-token timestep costs each block six (tokens x width) tensors written and read again (~1.2 GB at 24,576
    video tokens of the 19B), and the embedding itself (tokens x 6 x width) sits in memory for the whole
    forward. One row broadcasts through the same code: ltx-core's blocks add the table to a (B, 1, ...)
    timestep and the modulation broadcasts it over the tokens. Anything that copies the mask (a clone, a
    gather) loses the stride and with it only the saving: a copied mask is an ordinary per-token one."""
    return mask[:, :1].expand(mask.shape) if mask.dim() >= 2 and mask.shape[1] > 1 else mask


def _token_timesteps(mask: torch.Tensor) -> torch.Tensor:
    """The mask the timesteps are made from: one token's where `mask` holds one value for every token (stride
    0 along the tokens: `one_for_every_token`), else the mask itself."""
    return mask[:, :1] if mask.dim() >= 2 and mask.shape[1] > 1 and mask.stride(1) == 0 else mask


def modality(state: Any, context: torch.Tensor, sigma: torch.Tensor, batch: int = 1) -> Any:
    """A transformer `Modality` for `batch` rows sharing one latent state (contexts differ per row)."""
    from ltx_core.model.transformer import Modality

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.expand(batch, *t.shape[1:])

    sig = sigma.reshape(1).to(device=state.latent.device, dtype=torch.float32).expand(batch)
    return Modality(
        latent=rows(state.latent),
        sigma=sig,
        # (B, T, 1) or, for a mask uniform by construction, (B, 1, 1); X0Model needs the trailing 1
        timesteps=rows(_token_timesteps(state.denoise_mask)) * sig.view(-1, 1, 1),
        positions=rows(state.positions),
        context=context.to(device=state.latent.device, dtype=state.latent.dtype),
        context_mask=None,
        attention_mask=rows(state.attention_mask),
    )


def blend_clean(denoised: torch.Tensor, state: Any) -> torch.Tensor:
    """Keep conditioned tokens at their clean values: mask * denoised + (1 - mask) * clean."""
    mask = state.denoise_mask
    return (denoised.float() * mask + state.clean_latent.float() * (1 - mask)).to(denoised.dtype)


def encode_images(images: Sequence[Any], tools: Any, encoder: torch.nn.Module) -> list[torch.Tensor]:
    """VAE latents (1, C, 1, h, w) of the conditioning images at the stage's resolution."""
    from .images import to_model_input

    shape = tools.target_shape
    height, width = shape.height * 32, shape.width * 32
    param = next(encoder.parameters())
    out = []
    for img in images:
        pixels = to_model_input(img.pixels, height, width).to(device=param.device, dtype=param.dtype)
        with torch.inference_mode():
            out.append(encoder(pixels))
    return out


def image_latent_shape(tools: Any) -> tuple[int, ...]:
    shape = tools.target_shape
    return (1, int(shape.channels), 1, int(shape.height), int(shape.width))


def build_conditionings(images: Sequence[Any], latents: Sequence[torch.Tensor]) -> list[Any]:
    """ltx-core conditioning items: frame 0 replaces the first latent frame, later frames become appended
    keyframe tokens."""
    from ltx_core.conditioning import VideoConditionByKeyframeIndex, VideoConditionByLatentIndex

    out = []
    for img, latent in zip(images, latents, strict=True):
        if img.frame == 0:
            out.append(VideoConditionByLatentIndex(latent=latent, strength=img.strength, latent_idx=0))
        else:
            out.append(VideoConditionByKeyframeIndex(keyframes=latent, frame_idx=img.frame, strength=img.strength))
    return out


def upsample_latent(latent: torch.Tensor, encoder: torch.nn.Module, upsampler: torch.nn.Module) -> torch.Tensor:
    """x2 spatial upsampling in the un-normalised latent space (ltx-core's `upsample_video`)."""
    from ltx_core.model.upsampler import upsample_video

    param = next(upsampler.parameters())
    with torch.inference_mode():
        latent = latent.to(device=param.device, dtype=param.dtype)
        return upsample_video(latent=latent, video_encoder=encoder, upsampler=upsampler)


# =========================================================================================================
# Denoising
# =========================================================================================================


@dataclass(frozen=True)
class Pass:
    """One row of a guided forward: which contexts, which perturbations."""

    video_context: torch.Tensor
    audio_context: torch.Tensor
    perturbation: Any = None  # ltx-core PerturbationConfig, None = unperturbed


def run_passes(
    x0: torch.nn.Module,
    video_state: Any,
    audio_state: Any,
    sigma: torch.Tensor,
    passes: Sequence[Pass],
    max_batch: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Denoised (video, audio) for every pass; passes are batched `max_batch` rows per forward (one set of
    SP exchanges per forward instead of one per pass)."""
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig, PerturbationConfig

    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, len(passes), max(1, max_batch)):
        chunk = passes[start : start + max(1, max_batch)]
        b = len(chunk)
        video = modality(video_state, torch.cat([p.video_context for p in chunk]), sigma, b)
        audio = modality(audio_state, torch.cat([p.audio_context for p in chunk]), sigma, b)
        perturbations = BatchedPerturbationConfig([p.perturbation or PerturbationConfig.empty() for p in chunk])
        with torch.inference_mode():
            dv, da = x0(video, audio, perturbations)
        out.extend((dv[i : i + 1], da[i : i + 1]) for i in range(b))
    return out


def simple_denoise(x0: torch.nn.Module, max_batch: int, v_ctx: torch.Tensor, a_ctx: torch.Tensor) -> Callable:
    """Unguided denoising (distilled model / distilled LoRA): one conditional pass per step."""

    def step(video_state: Any, audio_state: Any, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_passes(x0, video_state, audio_state, sigma, [Pass(v_ctx, a_ctx)], max_batch)[0]

    return step


def guided_denoise(
    x0: torch.nn.Module,
    max_batch: int,
    *,
    positive: tuple[torch.Tensor, torch.Tensor],
    negative: tuple[torch.Tensor, torch.Tensor],
    video: GuidanceParams,
    audio: GuidanceParams,
    run: Callable[..., list[tuple[torch.Tensor, torch.Tensor]]] = run_passes,
) -> Callable:
    """Multi-modal guidance: conditional, unconditional (negative prompt), STG-perturbed and
    modality-isolated passes as needed, combined by ltx-core's `MultiModalGuider` per modality.

    `run` computes the passes (signature of `run_passes`); guidance parallelism passes
    `ltx_mgpu.parallel.GuidanceParallelPasses`, which spreads them over rank groups."""
    from ltx_core.components.guiders import MultiModalGuider
    from ltx_core.guidance.perturbations import Perturbation, PerturbationConfig, PerturbationType

    vg, ag = MultiModalGuider(video.to_ltx()), MultiModalGuider(audio.to_ltx())
    passes = {"cond": Pass(*positive)}
    if vg.do_unconditional_generation() or ag.do_unconditional_generation():
        passes["uncond"] = Pass(*negative)
    if vg.do_perturbed_generation() or ag.do_perturbed_generation():
        stg = []
        if vg.do_perturbed_generation():
            stg.append(Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, list(video.stg_blocks)))
        if ag.do_perturbed_generation():
            stg.append(Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, list(audio.stg_blocks)))
        passes["perturbed"] = Pass(*positive, PerturbationConfig(stg))
    if vg.do_isolated_modality_generation() or ag.do_isolated_modality_generation():
        isolate = [
            Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None),
        ]
        passes["modality"] = Pass(*positive, PerturbationConfig(isolate))
    names = list(passes)

    def step(video_state: Any, audio_state: Any, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = run(x0, video_state, audio_state, sigma, list(passes.values()), max_batch)
        results = dict(zip(names, outputs, strict=True))
        cv, ca = results["cond"]

        def pick(name: str, index: int) -> torch.Tensor | float:
            return results[name][index] if name in results else 0.0

        dv = vg.calculate(cv, pick("uncond", 0), pick("perturbed", 0), pick("modality", 0))
        da = ag.calculate(ca, pick("uncond", 1), pick("perturbed", 1), pick("modality", 1))
        return dv, da

    step.passes = len(names)  # type: ignore[attr-defined]
    return step
