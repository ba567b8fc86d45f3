"""`SmokeRunner`: a real text-to-video-with-audio render with the LTX-2 architecture at a tiny size.

Everything is the real machinery except the weights and the text encoder: the ltx-core AV transformer
(built by `SequenceParallelBuilder` around `SingleGPUModelBuilder` from a deterministic tiny safetensors
checkpoint), the LTX-2 scheduler, CFG guidance and Euler steps, the ltx-core video VAE decoder (tiny
config, x32/x8 geometry), the ltx-core audio VAE decoder and vocoder (tiny config, LTX-2's audio geometry:
25 latent frames per second -> 24 kHz stereo), and an mp4 (H.264 + AAC) written with PyAV on the driver
rank. It exists so the service, CI and demos exercise the whole path, SP included, on CPUs and GPUs
without real weights.

Request fields (`SmokeArgs`: ltx_contract/schema.py `RenderRequest` + `output_path`) and what the smoke model
does with them:

| field            | used as |
|------------------|---------|
| prompt           | hashed (sha256) into a deterministic embedding: the stand-in for the text encoder |
| negative_prompt  | hashed the same way; the unconditional row when guidance_scale > 1 |
| seed             | the initial noise (drawn on the CPU: same bits on every rank and device) |
| width, height    | multiples of 32 (one latent cell per 32x32 pixels) |
| num_frames       | 8k + 1 (one latent frame per 8 frames after the first) |
| frame_rate       | RoPE time positions and the mp4 frame rate |
| steps            | denoising steps (default: setup's `default_steps`) |
| guidance_scale   | CFG scale (default 1.0: no guidance, batch 1; > 1 runs a batch of 2 through SP) |
| images           | refused (`ValueError`): the smoke model takes no conditioning images |
| loras            | refused (`ValueError`): the smoke model takes no LoRAs |
| enhance_prompt   | accepted and ignored (no prompt-enhancer model in the smoke setup) |
| audio            | decode the denoised audio latent and mux it as AAC (default); False: a silent mp4 |
| output_path      | where the driver rank writes the mp4 |

The audio latent is denoised alongside the video on every rank (it takes part in every block's
audio-video attention); the driver decodes it (audio VAE decoder + vocoder, no torchaudio needed) and
fits it to the video's duration.

Events (driver rank only): stage encode / denoise, one progress per step, stage decode, stage
audio_decode (when audio is on), stage mux (or, with `media="frames"`, a `media` hand-off event and no
file; with `media="stream"` the same frames as one streamed chunk: `common.handoff`), output (with
`audio`, `audio_sample_rate`, `audio_duration_s`, `timings_s` and the device-busy clock `gpu_busy_s`,
`gpu_started_at`, `gpu_ended_at`). Limits are checked on every rank
before any collective and raise `ValueError` (a recoverable `SymmetricRunnerError` for the caller).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...control.events import Stage, output_event, progress_event, stage_event
from ...control.runner import MGPURunner
from ...media.mp4 import AudioTrack, EncodeOptions, audio_fields
from ...parallel import check_token_budget, padded_token_count
from ...spec.bounds import check_audio_budget
from ..common.args import MEDIA_MODES, RenderArgs, job_entry
from ..common.audio import AudioDecoding, build_audio_decoding
from ..common.handoff import deliver_video
from ..common.loading import build_checked, build_sp_transformer
from ..common.stages import StageClock, check_finite, ltx2_sigmas
from .checkpoint import ensure_smoke_checkpoint
from .denoise import SmokeGeometry, audio_latent, decode_frames, denoise_step, initial_states, prompt_embedding

__all__ = ["SmokeArgs", "SmokeRunner"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class SmokeArgs(RenderArgs):
    """The smoke model's job: `RenderArgs` with a small default size (256x256, 17 frames)."""

    width: int = 256
    height: int = 256
    num_frames: int = 17


class SmokeRunner(MGPURunner):
    """Tiny LTX-2 text-to-video with sequence parallelism over the fleet; see the module docstring."""

    media_modes = MEDIA_MODES  #: "stream" hands the whole decode off as one chunk (`common.handoff.deliver_video`)

    @classmethod
    def takes_request_loras(cls, **setup_kwargs: Any) -> bool:
        """The smoke model takes no LoRAs (it refuses a job's `loras` on every rank)."""
        return False

    @classmethod
    def request_limits(cls, **setup_kwargs: Any) -> dict[str, tuple[float, float]]:
        """`steps` in [1, max_steps] and the audio length within the token budget (what `_validate`
        enforces on every rank)."""
        return {
            "steps": (1, int(cls.setup_default("max_steps", setup_kwargs))),
            "audio_latents": (1, int(cls.setup_default("max_tokens", setup_kwargs))),
        }

    def setup(
        self,
        *,
        checkpoint_dir: str | None = None,
        max_tokens: int = 6144,
        max_steps: int = 50,
        default_steps: int = 4,
        dtype: str = "float32",
        backend: str = "auto",
        transformer_config: dict[str, Any] | None = None,
        crf: int = 18,
    ) -> None:
        """Create the checkpoint if missing (rank 0, then a barrier), build the SP transformer on every
        rank and the video VAE decoder, audio decoder and vocoder on the driver.

        Args:
            checkpoint_dir: cache directory for the generated checkpoint (default `$LTX_MGPU_CACHE/smoke`
                or `~/.cache/ltx-mgpu/smoke`).
            max_tokens: the SP token budget (padded video tokens x batch); 6144 is LTX-2's stage-1 size
                (768x512, 121 frames). Larger requests fail with "Use a smaller resolution or fewer frames."
            max_steps, default_steps: bounds and default for `steps`.
            dtype: "float32" (default), "bfloat16" or "float16".
            backend: all2all backend ("auto", "dist", "ipc").
            transformer_config: override the tiny transformer config (tests); heads must divide by the
                world size.
            crf: H.264 quality (0 = lossless, so tests can compare decoded frames across world sizes
                without the encoder's mode decisions amplifying last-bit differences).
        """
        from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
        from ltx_core.model.transformer.model import X0Model
        from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
        from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator

        # CPU ranks' thread pools are sized by the fleet (ltx_mgpu/control/fleet.py: the machine's cores split among
        # the ranks, unless OMP_NUM_THREADS says otherwise).
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.max_tokens = int(max_tokens)
        self.max_steps = int(max_steps)
        self.default_steps = int(default_steps)
        self.crf = int(crf)
        # Rank 0 writes the checkpoint, everyone else waits: one writer, and no rank reads a partial file
        # (the writes are also atomic, so separate fleets sharing a cache directory are safe too).
        if self.is_driver:
            ckpt = ensure_smoke_checkpoint(checkpoint_dir, transformer_config=transformer_config)
        if self.world_size > 1:
            dist.barrier(group=self.groups.control_group)
        if not self.is_driver:
            ckpt = ensure_smoke_checkpoint(checkpoint_dir, transformer_config=transformer_config)
        self.checkpoint = ckpt

        inner = SingleGPUModelBuilder(LTXModelConfigurator, str(ckpt.transformer_path))
        cfg = inner.model_config()["transformer"]
        self.latent_channels = int(cfg["in_channels"])
        self.audio_channels = int(cfg["audio_in_channels"])
        self.caption_channels = int(cfg["caption_channels"])
        self.attention, self.transformer = build_sp_transformer(
            inner, self, max_tokens=self.max_tokens, dtype=self.dtype, backend=backend, build_dtype=self.dtype
        )
        self.x0 = X0Model(self.transformer)
        self.decoder = None
        self.audio: AudioDecoding | None = None
        if self.is_driver:  # only the driver decodes and encodes
            self.decoder = build_checked(
                SingleGPUModelBuilder(VideoDecoderConfigurator, str(ckpt.decoder_path)),
                self.device,
                self.dtype,
                "video decoder",
            )
            self.audio = build_audio_decoding(str(ckpt.audio_path), self.device, torch.float32)  # small; no bf16 hiss
        self.clock = StageClock(self.device)

    # ---- validation (every rank, before any collective) ----------------------------------------------
    def _validate(self, geo: SmokeGeometry, steps: int, guidance_scale: float, output_path: str) -> None:
        if geo.width <= 0 or geo.height <= 0 or geo.width % 32 or geo.height % 32:
            raise ValueError(f"width and height must be positive multiples of 32, got {geo.width}x{geo.height}")
        if geo.num_frames < 1 or (geo.num_frames - 1) % 8:
            raise ValueError(f"num_frames must be 8k+1 (1, 9, 17, ...), got {geo.num_frames}")
        check_audio_budget(geo.num_frames, geo.frame_rate, self.max_tokens)
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"steps must be in [1, {self.max_steps}] for the smoke model, got {steps}")
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0, got {guidance_scale}")
        if not output_path:
            raise ValueError("output_path is required")
        batch = 2 if guidance_scale > 1.0 else 1
        check_token_budget(padded_token_count(geo.video_tokens, self.world_size), batch, self.max_tokens)

    # ---- the last float stages before the encoders (driver only) ----------------------------------
    # Methods so tests can compare renders across fleet layouts here, where the float paths differ by
    # reduction order only, instead of after x264 and AAC, whose mode decisions turn a one-level (or
    # one-ulp) difference into many levels.
    def decode_video(self, geo: SmokeGeometry, video_state: Any) -> torch.Tensor:
        """The denoised video state -> uint8 frames (F, H, W, 3), what x264 gets."""
        assert self.decoder is not None  # built on the driver
        return decode_frames(self.decoder, geo, video_state)

    def decode_audio(self, geo: SmokeGeometry, audio_state: Any) -> AudioTrack:
        """The denoised audio state -> a float waveform (before fitting to the video's duration)."""
        assert self.audio is not None  # built on the driver
        return self.audio.decode(audio_latent(geo, audio_state))

    # ---- one job -------------------------------------------------------------------------------------
    __call__ = job_entry(SmokeArgs)

    def render(self, args: SmokeArgs) -> Iterator[dict[str, Any]]:
        """One job on every rank (SPMD); the driver yields the events and writes the file."""
        steps = self.default_steps if args.steps is None else int(args.steps)
        scale = 1.0 if args.guidance_scale is None else float(args.guidance_scale)
        geo = SmokeGeometry(
            width=int(args.width),
            height=int(args.height),
            num_frames=int(args.num_frames),
            frame_rate=float(args.frame_rate),
            latent_channels=self.latent_channels,
            audio_channels=self.audio_channels,
        )
        if args.images:
            raise ValueError("the smoke runner takes no conditioning images")
        if args.loras:
            raise ValueError("the smoke runner takes no LoRAs")
        self._validate(geo, steps, scale, args.output_path)
        driver, clock = self.is_driver, self.clock
        clock.reset()

        if driver:
            yield stage_event(Stage.ENCODE)
        with clock.stage(Stage.ENCODE):
            rows = [prompt_embedding(args.prompt, self.caption_channels)]
            if scale > 1.0:
                rows.append(prompt_embedding(args.negative_prompt, self.caption_channels))
            context = torch.stack(rows).to(device=self.device, dtype=self.dtype)
            video_state, audio_state = initial_states(geo, args.seed, self.device, self.dtype)
        latent_shape = (1, geo.latent_channels, geo.latent_frames, geo.latent_height, geo.latent_width)
        sigmas = ltx2_sigmas(steps, latent_shape)

        if driver:
            yield stage_event(Stage.DENOISE, steps=steps, video_tokens=geo.video_tokens, world_size=self.world_size)
        with clock.stage(Stage.DENOISE):
            for step in range(steps):
                self.raise_if_cancelled()  # every rank takes the same branch at the same call
                video_state, audio_state = denoise_step(self.x0, video_state, audio_state, sigmas, step, context, scale)
                if driver:
                    yield progress_event(Stage.DENOISE, step + 1, steps)
        check_finite(video=video_state.latent, audio=audio_state.latent)  # every rank: a symmetric failure

        if not driver:
            return None
        yield stage_event(Stage.DECODE)
        with clock.stage(Stage.DECODE):
            frames = self.decode_video(geo, video_state)
        track = None
        if args.audio:
            yield stage_event(Stage.AUDIO_DECODE)
            with clock.stage(Stage.AUDIO_DECODE):
                track = self.decode_audio(geo, audio_state).fitted(args.duration_s)
        size = yield from deliver_video(clock, args, frames, geo.frame_rate, track, EncodeOptions(crf=self.crf))
        yield output_event(
            os.fspath(args.output_path),
            frames=int(frames.shape[0]),
            fps=geo.frame_rate,
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
            size_bytes=size,
            seed=int(args.seed),
            steps=steps,
            world_size=self.world_size,
            **audio_fields(track),
            **({"media": args.media} if args.media != "mp4" else {}),
            timings_s=dict(clock.timings_s),
            **clock.gpu_report(),
        )
        return None
