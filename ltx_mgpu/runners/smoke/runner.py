"""`SmokeRunner`: a real text-to-video render with the LTX-2 architecture at a tiny size.

Everything is the real machinery except the weights and the text encoder: the ltx-core AV transformer
(built by `SequenceParallelBuilder` around `SingleGPUModelBuilder` from a deterministic tiny safetensors
checkpoint), the LTX-2 scheduler, CFG guidance and Euler steps, the ltx-core video VAE decoder (tiny
config, x32/x8 geometry), and an H.264 mp4 written with PyAV on the driver rank. It exists so the
service, CI and demos exercise the whole path, SP included, on CPUs and GPUs without real weights.

Request fields (worker/schema.py `RenderRequest` + `output_path`) and what the smoke model does with them:

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
| enhance_prompt   | accepted and ignored (no prompt-enhancer model in the smoke setup) |
| output_path      | where the driver rank writes the mp4 |

The audio latent is denoised alongside the video (it takes part in every block's audio-video attention),
but not decoded: the smoke model has no audio VAE/vocoder (ltx-core's needs torchaudio), so the mp4 is
video-only.

Events (driver rank only): stage encode / denoise, one progress per step, stage decode, stage mux, output.
Limits are checked on every rank before any collective and raise `ValueError` (a recoverable
`SymmetricRunnerError` for the caller).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...events import output_event, progress_event, stage_event
from ...parallel import AttentionManager, SequenceParallelBuilder, check_token_budget, padded_token_count
from ...runner import MGPURunner
from .checkpoint import ensure_smoke_checkpoint
from .pipeline import SmokeGeometry, decode_frames, denoise_step, initial_states, prompt_embedding
from .video_io import write_mp4

__all__ = ["SmokeRunner"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SmokeRunner(MGPURunner):
    """Tiny LTX-2 text-to-video with sequence parallelism over the fleet; see the module docstring."""

    @classmethod
    def request_limits(cls, **setup_kwargs: Any) -> dict[str, tuple[float, float]]:
        """`steps` in [1, max_steps] (what `_validate` enforces on every rank)."""
        return {"steps": (1, int(cls.setup_default("max_steps", setup_kwargs)))}

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
        rank and the VAE decoder on the driver.

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

        if self.device.type == "cpu":
            # CPU ranks share the machine's cores: one OpenMP pool per rank sized to its share, or the
            # ranks' spinning thread pools fight over the cores at every collective (seconds per job).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
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
        self.attention = AttentionManager(
            self.max_tokens,
            int(cfg["num_attention_heads"]),
            int(cfg["attention_head_dim"]),
            self.dtype,
            self.groups.transformer_group,
            backend=backend,
            device=self.device,
        )
        self.transformer = SequenceParallelBuilder(inner, self.attention).build(device=self.device, dtype=self.dtype)
        self.x0 = X0Model(self.transformer)
        self.decoder = None
        if self.is_driver:  # only the driver decodes and encodes
            self.decoder = (
                SingleGPUModelBuilder(VideoDecoderConfigurator, str(ckpt.decoder_path))
                .build(device=self.device, dtype=self.dtype)
                .eval()
            )

    # ---- validation (every rank, before any collective) ----------------------------------------------
    def _validate(self, geo: SmokeGeometry, steps: int, guidance_scale: float, output_path: str) -> None:
        if geo.width <= 0 or geo.height <= 0 or geo.width % 32 or geo.height % 32:
            raise ValueError(f"width and height must be positive multiples of 32, got {geo.width}x{geo.height}")
        if geo.num_frames < 1 or (geo.num_frames - 1) % 8:
            raise ValueError(f"num_frames must be 8k+1 (1, 9, 17, ...), got {geo.num_frames}")
        if not geo.frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, got {geo.frame_rate}")
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"steps must be in [1, {self.max_steps}] for the smoke model, got {steps}")
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0, got {guidance_scale}")
        if not output_path:
            raise ValueError("output_path is required")
        batch = 2 if guidance_scale > 1.0 else 1
        check_token_budget(padded_token_count(geo.video_tokens, self.world_size), batch, self.max_tokens)

    # ---- one job -------------------------------------------------------------------------------------
    def __call__(
        self,
        *,
        output_path: str,
        prompt: str,
        negative_prompt: str = "",
        seed: int = 42,
        width: int = 256,
        height: int = 256,
        num_frames: int = 17,
        frame_rate: float = 24.0,
        steps: int | None = None,
        guidance_scale: float | None = None,
        enhance_prompt: bool = False,  # accepted for the schema; the smoke model has no prompt enhancer
    ) -> Iterator[dict[str, Any]]:
        from ltx_core.components.schedulers import LTX2Scheduler

        del enhance_prompt
        steps = self.default_steps if steps is None else int(steps)
        scale = 1.0 if guidance_scale is None else float(guidance_scale)
        geo = SmokeGeometry(
            width=int(width),
            height=int(height),
            num_frames=int(num_frames),
            frame_rate=float(frame_rate),
            latent_channels=self.latent_channels,
            audio_channels=self.audio_channels,
        )
        self._validate(geo, steps, scale, output_path)
        driver = self.is_driver

        if driver:
            yield stage_event("encode")
        rows = [prompt_embedding(prompt, self.caption_channels)]
        if scale > 1.0:
            rows.append(prompt_embedding(negative_prompt, self.caption_channels))
        context = torch.stack(rows).to(device=self.device, dtype=self.dtype)
        video_state, audio_state = initial_states(geo, seed, self.device, self.dtype)
        latent_shape = (1, geo.latent_channels, geo.latent_frames, geo.latent_height, geo.latent_width)
        sigmas = LTX2Scheduler().execute(steps=steps, latent=torch.empty(latent_shape, device="meta"))

        if driver:
            yield stage_event("denoise", steps=steps, video_tokens=geo.video_tokens, world_size=self.world_size)
        for step in range(steps):
            self.raise_if_cancelled()  # collective: every rank takes the same branch
            video_state, audio_state = denoise_step(self.x0, video_state, audio_state, sigmas, step, context, scale)
            if driver:
                yield progress_event("denoise", step + 1, steps)

        if not driver:
            return None
        yield stage_event("decode")
        frames = decode_frames(self.decoder, geo, video_state)
        yield stage_event("mux")
        size = write_mp4(frames, output_path, geo.frame_rate, crf=self.crf)
        yield output_event(
            os.fspath(output_path),
            frames=int(frames.shape[0]),
            fps=geo.frame_rate,
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
            size_bytes=size,
            seed=int(seed),
            steps=steps,
            world_size=self.world_size,
        )
        return None
