"""The LTX-2 runners: `Ltx2DistilledRunner` ("ltx2-distilled") and `Ltx2TwoStageRunner` ("ltx2-two-stage").

Both render text/image-to-video in two stages (half resolution, x2 latent upsampler, refinement at full
resolution) on a fleet, with every parallel piece of this package:

| step     | distilled runner                      | two-stage runner                                  |
|----------|---------------------------------------|---------------------------------------------------|
| prompt   | Gemma on one rank, broadcast          | same (or batch-parallel replicas for +/- prompts) |
| stage 1  | SP, 8 distilled sigmas, no guidance   | SP, LTX2 scheduler, CFG/STG/modality guidance     |
| upsample | x2 latent upsampler on the driver     | same, broadcast to every rank                     |
| stage 2  | SP (same resident model), 3 sigmas    | TDP sibling sharing the weights + distilled LoRA  |
| decode   | distributed VAE decode, blended and written on the driver | same                  |

One transformer is resident per rank; the LoRA tracker switches the distilled LoRA in and out in place
(sharded fusion + broadcast), so stage 1 and stage 2 share weights and nothing is reloaded per job.

Setup kwargs (every rank): `checkpoint_path` (the LTX-2 monolith: transformer, VAE, text projection),
`spatial_upsampler_path`, `gemma_root`, `distilled_lora_path` (two-stage, required),
`distilled_lora_strength`, `loras` ([(path, strength), ...] extra LoRAs), `quantization` (None,
"fp8-cast", "fp8-scaled-mm": passed to the transformer builder, never ignored), `dtype`,
`sp_max_tokens`, `sp_backend`, `tdp_tiles`/`tdp_overlap`, `vae_tiles`/`vae_overlap`/`vae_chunked`,
`text_encoder` ("source" | "batch-parallel"), `text_encoder_rank`, `prompt_tokens`,
`enhance_max_new_tokens`, `default_steps`, `max_steps`, `stage2_sigmas`, `stg_blocks`, `stage1_guidance`
(two-stage: `{"video": {...}, "audio": {...}}` overriding the reference's stage-1 guidance, fields of
`GuidanceParams`; e.g. CFG only, 2 passes a step: `stg_scale` 0, `modality_scale` 1, `rescale_scale` 0).

Job kwargs: worker/schema.py `RenderRequest.runner_kwargs()` + `output_path`. Every request check runs on
every rank before any collective and raises `ValueError` (a recoverable `SymmetricRunnerError`).

Audio: the AV transformer denoises the audio latent with the video (stage 2 of the two-stage runner keeps
stage 1's audio as fixed conditioning, since tiled audio is meaningless), but the mp4 is video-only: the
audio VAE and vocoder of ltx-core need torchaudio, which this install does not have.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from ...errors import RunnerError
from ...events import output_event, progress_event, stage_event
from ...parallel import AttentionManager, SequenceParallelBuilder, check_token_budget, padded_token_count
from ...parallel.builder import SP_MODULE_OPS_NAME
from ...parallel.collectives import broadcast_tensor
from ...parallel.lora_tracker import LoraSpec, LoraWeightTracker
from ...parallel.tdp import BalancedTiling, TiledDataParallelBuilder
from ...parallel.text_encoder import BatchParallelPromptEncoder, DistributedPromptEncoder
from ...parallel.vae_decode import DistributedDecoderBuilder, vae_tiles
from ...runner import MGPURunner
from . import components as comp
from .media import parse_images, write_mp4
from .pipeline import (
    DISTILLED_SIGMAS,
    STAGE2_DISTILLED_SIGMAS,
    STAGE2_TDP_SIGMAS,
    Geometry,
    GuidanceParams,
    blend_clean,
    build_conditionings,
    encode_images,
    guided_denoise,
    image_latent_shape,
    make_state,
    simple_denoise,
    upsample_latent,
)

__all__ = ["DEFAULT_NEGATIVE_PROMPT", "Ltx2DistilledRunner", "Ltx2TwoStageRunner"]

DEFAULT_NEGATIVE_PROMPT = (
    "blurry, out of focus, low resolution, noisy, distorted, deformed, watermark, text, flicker, jitter, "
    "washed out colors, bad anatomy, static frame, muted or distorted audio"
)


class _Ltx2Runner(MGPURunner):
    """Shared setup and stages; see the module docstring."""

    two_stage = False  #: the two-stage runner: guided stage 1, TDP + distilled LoRA stage 2

    # =====================================================================================================
    # setup
    # =====================================================================================================
    def setup(
        self,
        *,
        checkpoint_path: str,
        spatial_upsampler_path: str,
        gemma_root: str,
        distilled_lora_path: str | None = None,
        distilled_lora_strength: float = 1.0,
        loras: list | tuple = (),
        quantization: str | None = None,
        dtype: str = "bfloat16",
        sp_max_tokens: int = 32768,
        sp_backend: str = "auto",
        tdp_tiles: int | None = None,
        tdp_overlap: int = 2,
        vae_tiles: int | None = None,
        vae_overlap: int = 1,
        vae_chunked: bool = False,
        text_encoder: str = "source",
        text_encoder_rank: int = 0,
        prompt_tokens: int = 1024,
        enhance_max_new_tokens: int = 512,
        default_steps: int | None = None,
        max_steps: int = 100,
        stage2_sigmas: list[float] | None = None,
        stg_blocks: list[int] | None = None,
        stage1_guidance: dict[str, dict[str, float]] | None = None,
    ) -> None:
        self.dtype = comp.parse_dtype(dtype)
        self.quantization_name = quantization
        policy = comp.quantization_policy(quantization)
        if policy is not None and self.dtype != torch.bfloat16:
            raise ValueError("quantized transformers run in bfloat16: set dtype='bfloat16'")
        if text_encoder not in ("source", "batch-parallel"):
            raise ValueError(f"text_encoder must be 'source' or 'batch-parallel', got {text_encoder!r}")
        if self.two_stage and not distilled_lora_path:
            raise ValueError("the two-stage runner needs distilled_lora_path (stage 2 runs with the distilled LoRA)")
        if (self.two_stage or loras) and policy is None and self.dtype != torch.bfloat16:
            raise ValueError("LoRA fusion (ltx-core apply_loras) needs bfloat16 or fp8 weights: set dtype='bfloat16'")
        self.max_steps = int(max_steps)
        self.sp_max_tokens = int(sp_max_tokens)
        groups = self.groups

        # ---- transformer: one resident SP model per rank (+ a TDP sibling sharing its weights) ----------
        tb = comp.transformer_builder(checkpoint_path, quantization=policy)
        config = tb.model_config()
        tcfg = config["transformer"]
        self.latent_channels = int(tcfg["in_channels"])
        self.audio_channels = int(tcfg["audio_in_channels"])
        self.num_layers = int(tcfg["num_layers"])
        self.attention = AttentionManager(
            self.sp_max_tokens,
            int(tcfg["num_attention_heads"]),
            int(tcfg["attention_head_dim"]),
            self.dtype,
            groups.transformer_group,
            backend=sp_backend,
            device=self.device,
        )
        build_dtype = None if policy is not None else self.dtype  # quantized weights keep their fp8 dtype
        self.sp_model = SequenceParallelBuilder(tb, self.attention).build(device=self.device, dtype=build_dtype)
        self._check_quantized(policy)
        from ltx_core.model.transformer import X0Model

        self.x0_sp = X0Model(self.sp_model)
        self.tdp_model = None
        if self.two_stage:
            tiles = max(self.world_size, int(tdp_tiles or self.world_size))
            self.tdp_tiling = BalancedTiling(tiles, overlap=int(tdp_overlap))
            tdp = TiledDataParallelBuilder(tb, tiling=self.tdp_tiling, group=groups.transformer_group)
            self.tdp_model = tdp.build_sharing(self.sp_model.model, drop_module_ops=[SP_MODULE_OPS_NAME])
            self.x0_tdp = X0Model(self.tdp_model)
        self.stage2_sigmas = tuple(
            float(s)
            for s in (
                stage2_sigmas
                or (STAGE2_TDP_SIGMAS if self.two_stage and self.world_size > 1 else STAGE2_DISTILLED_SIGMAS)
            )
        )
        if len(self.stage2_sigmas) < 2 or self.stage2_sigmas[-1] != 0.0:
            raise ValueError(f"stage2_sigmas must have >= 2 values and end at 0.0, got {self.stage2_sigmas}")

        # ---- LoRAs: the tracker keeps weights resident and swaps them in place ------------------------
        from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

        self.base_loras = tuple(LoraSpec(str(p), float(s), LTXV_LORA_COMFY_RENAMING_MAP) for p, s in loras)
        self.stage2_loras = self.base_loras
        if self.two_stage:
            distilled = LoraSpec(str(distilled_lora_path), float(distilled_lora_strength), LTXV_LORA_COMFY_RENAMING_MAP)
            self.stage2_loras = (*self.base_loras, distilled)
        self.tracker = None
        if self.base_loras or self.stage2_loras:
            self.tracker = LoraWeightTracker(groups.transformer_group)
            self.tracker.attach(self.sp_model.model)
            self.tracker.apply(self.base_loras)

        # ---- VAE: decoder on every rank (tiles), encoder + upsampler on the driver only ---------------
        from ltx_core.model.video_vae import TilingConfig

        self.vae_tiling = BalancedTiling(max(1, int(vae_tiles or self.world_size)), overlap=int(vae_overlap))
        self.decoder = DistributedDecoderBuilder(
            comp.video_decoder_builder(checkpoint_path),
            group=groups.vae_group,
            tiling=self.vae_tiling,
            chunk_tiling=TilingConfig.default() if vae_chunked else None,
        ).build(self.device, self.dtype)
        self.encoder = self.upsampler = None
        if self.is_driver:
            self.encoder = comp.build_checked(
                comp.video_encoder_builder(checkpoint_path), self.device, self.dtype, "video encoder"
            )
            self.upsampler = comp.build_checked(
                comp.upsampler_builder(spatial_upsampler_path), self.device, self.dtype, "spatial upsampler"
            )

        # ---- prompt encoder ------------------------------------------------------------------------------
        from .text import build_gemma_prompt_encoder

        def local_encoder() -> Any:
            return build_gemma_prompt_encoder(
                gemma_root,
                checkpoint_path,
                device=self.device,
                dtype=self.dtype,
                max_tokens=int(prompt_tokens),
                enhance_max_new_tokens=int(enhance_max_new_tokens),
            )

        if text_encoder == "batch-parallel":
            self.text = BatchParallelPromptEncoder(local_encoder(), group=groups.gemma_group, device=self.device)
        else:
            src = int(text_encoder_rank)
            if not 0 <= src < self.world_size:
                raise ValueError(f"text_encoder_rank {src} is outside the fleet (size {self.world_size})")
            encoder = local_encoder() if self.rank == src else None
            self.text = DistributedPromptEncoder(encoder, group=groups.gemma_group, device=self.device, src_rank=src)

        # ---- defaults from the checkpoint's model version (LTX-2.0 vs 2.3) ----------------------------
        version = str(comp.checkpoint_metadata(checkpoint_path).get("model_version", ""))
        self.default_steps = int(default_steps or (30 if version.startswith("2.3") else 40))
        block = 28 if version.startswith("2.3") else 29
        blocks = stg_blocks if stg_blocks is not None else [min(block, self.num_layers - 1)]
        if any(not 0 <= int(b) < self.num_layers for b in blocks):
            raise ValueError(f"stg_blocks {blocks} outside the transformer's {self.num_layers} blocks")
        self.stg_blocks = tuple(int(b) for b in blocks)
        self.stage1_guidance = _stage1_guidance(stage1_guidance or {}, self.stg_blocks)
        self.peaks: dict[str, int] = {}

    def _check_quantized(self, policy: Any) -> None:
        """Prove the quantization policy took effect (the reference's CLIs silently dropped it)."""
        if policy is None:
            return
        dtypes = {p.dtype for p in self.sp_model.model.parameters()}
        if self.quantization_name == "fp8-cast" and torch.float8_e4m3fn not in dtypes:
            raise RuntimeError("quantization 'fp8-cast' was requested but no transformer weight is float8")

    # =====================================================================================================
    # helpers
    # =====================================================================================================
    def _sync(self, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank 0's tensor on every rank (the driver computed it; others pass None)."""
        if tensor is None:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        tensor = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        return broadcast_tensor(tensor, 0, self.groups.transformer_group) if self.world_size > 1 else tensor

    def _stage_begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _stage_end(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks[name] = int(torch.cuda.max_memory_allocated(self.device))

    def _peak_report(self) -> dict[str, list[int]] | None:
        """Collective: per-stage peak accelerator memory of every rank (None on CPU fleets)."""
        if self.device.type != "cuda":
            return None
        gathered: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(gathered, self.peaks, group=self.groups.control_group)
        else:
            gathered = [self.peaks]
        return {stage: [int(g.get(stage, 0)) for g in gathered] for stage in self.peaks}

    def _validate(
        self, geo: Geometry, steps: int, images: list, output_path: str, guidance_rows: int
    ) -> None:  # every rank, before any collective
        if geo.width % 64 or geo.height % 64 or geo.width <= 0 or geo.height <= 0:
            raise ValueError(f"width and height must be positive multiples of 64, got {geo.width}x{geo.height}")
        if geo.num_frames < 1 or (geo.num_frames - 1) % 8:
            raise ValueError(f"num_frames must be 8k+1 (1, 9, 17, ...), got {geo.num_frames}")
        if not geo.frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, got {geo.frame_rate}")
        low = 2 if self.two_stage else 1  # ltx-core's LTX2Scheduler yields a NaN sigma for a single step
        if not low <= steps <= self.max_steps:
            raise ValueError(f"steps must be in [{low}, {self.max_steps}], got {steps}")
        if not output_path:
            raise ValueError("output_path is required")
        # SP budget: the smallest forward (one row) of every SP stage must fit; guidance rows are batched
        # only as far as the budget allows (see `_max_batch`).
        check_token_budget(padded_token_count(self._sp_tokens(geo, 2), self.world_size), 1, self.sp_max_tokens)
        if not self.two_stage:
            check_token_budget(padded_token_count(self._sp_tokens(geo, 1), self.world_size), 1, self.sp_max_tokens)
        else:
            shape = geo.video_tools(1).target_shape
            self.tdp_tiling.grid_for((shape.frames, shape.height, shape.width))  # raises if it cannot tile
        full = geo.video_tools(1).target_shape
        vae_tiles((1, self.latent_channels, full.frames, full.height, full.width), self.vae_tiling)
        del images, guidance_rows

    def _sp_tokens(self, geo: Geometry, scale: int) -> int:
        return geo.tokens(scale)

    def _max_batch(self, tokens: int) -> int:
        return max(1, self.sp_max_tokens // padded_token_count(tokens, self.world_size))

    def _encode(self, prompt: str, negative: str | None, images: list, seed: int, enhance: bool) -> tuple:
        if enhance:
            first = next((img.pixels for img in images if img.frame == 0), None)
            prompt = self.text.enhance(prompt, image=first, seed=seed)
        prompts = [prompt] if negative is None else [prompt, negative]
        encodings = self.text.encode(prompts)
        pos = (encodings[0]["video"].to(self.dtype), encodings[0]["audio"].to(self.dtype))
        neg = None
        if negative is not None:
            neg = (encodings[1]["video"].to(self.dtype), encodings[1]["audio"].to(self.dtype))
        return prompt, pos, neg

    def _conditionings(self, images: list, tools: Any) -> list:
        """Image latents encoded on the driver, broadcast, turned into conditioning items on every rank."""
        if not images:
            return []
        latents = encode_images(images, tools, self.encoder) if self.is_driver else [None] * len(images)
        shape = image_latent_shape(tools)
        return build_conditionings(images, [self._sync(lat, shape) for lat in latents])

    def _denoise(
        self, x0: Any, step_fn: Any, sigmas: torch.Tensor, video_state: Any, audio_state: Any, stage: str
    ) -> Iterator[Any]:
        """Euler loop with one cancellation check (collective) per step; yields progress on the driver and
        finally the (video_state, audio_state) pair as a tuple."""
        from ltx_core.components.diffusion_steps import EulerDiffusionStep

        euler = EulerDiffusionStep()
        total = len(sigmas) - 1
        for i in range(total):
            self.raise_if_cancelled()
            dv, da = step_fn(video_state, audio_state, sigmas[i])
            dv, da = blend_clean(dv, video_state), blend_clean(da, audio_state)
            video_state = replace(video_state, latent=euler.step(video_state.latent, dv, sigmas, i))
            audio_state = replace(audio_state, latent=euler.step(audio_state.latent, da, sigmas, i))
            if self.is_driver:
                yield progress_event(stage, i + 1, total)
        del x0
        yield (video_state, audio_state)

    # =====================================================================================================
    # one job
    # =====================================================================================================
    def _render(
        self,
        *,
        output_path: str,
        prompt: str,
        negative_prompt: str,
        seed: int,
        width: int,
        height: int,
        num_frames: int,
        frame_rate: float,
        steps: int,
        guidance_scale: float | None,
        images: Any,
        enhance_prompt: bool,
    ) -> Iterator[dict[str, Any]]:
        geo = Geometry(
            int(width), int(height), int(num_frames), float(frame_rate), self.latent_channels, self.audio_channels
        )
        conditioning_images = parse_images(images, geo.num_frames)
        self._validate(geo, steps, conditioning_images, output_path, 4)
        driver = self.is_driver
        gen = torch.Generator().manual_seed(int(seed))  # CPU noise: identical on every rank and device
        self.peaks = {}

        # ---- prompt -------------------------------------------------------------------------------------
        if driver:
            yield stage_event("encode")
        self._stage_begin()
        negative = (negative_prompt or DEFAULT_NEGATIVE_PROMPT) if self.two_stage else None
        used_prompt, pos, neg = self._encode(prompt, negative, conditioning_images, seed, enhance_prompt)
        self._stage_end("encode")

        # ---- stage 1: half resolution, SP --------------------------------------------------------------
        tools1 = geo.video_tools(2)
        audio_tools = geo.audio_tools()
        if self.tracker is not None:
            self.tracker.apply(self.base_loras)  # collective; a no-op when already clean
        self._stage_begin()
        cond1 = self._conditionings(conditioning_images, tools1)
        video_state = make_state(tools1, cond1, generator=gen, noise_scale=1.0, device=self.device, dtype=self.dtype)
        audio_state = make_state(audio_tools, [], generator=gen, noise_scale=1.0, device=self.device, dtype=self.dtype)
        max_batch = self._max_batch(video_state.latent.shape[1])
        if self.two_stage:
            from ltx_core.components.schedulers import LTX2Scheduler

            shape = tools1.target_shape
            probe = torch.empty((1, shape.channels, shape.frames, shape.height, shape.width), device="meta")
            sigmas1 = LTX2Scheduler().execute(steps=steps, latent=probe).to(torch.float32)
            video_guidance, audio_guidance = self.stage1_guidance
            if guidance_scale is not None:  # the request's scale is the video CFG scale
                video_guidance = replace(video_guidance, cfg_scale=float(guidance_scale))
            step_fn = guided_denoise(
                self.x0_sp, max_batch, positive=pos, negative=neg, video=video_guidance, audio=audio_guidance
            )
        else:
            sigmas1 = torch.tensor(DISTILLED_SIGMAS, dtype=torch.float32)
            step_fn = simple_denoise(self.x0_sp, max_batch, *pos)
        if driver:
            yield stage_event(
                "stage1",
                steps=len(sigmas1) - 1,
                video_tokens=int(video_state.latent.shape[1]),
                world_size=self.world_size,
                passes=int(getattr(step_fn, "passes", 1)),  # transformer passes per step (guidance)
            )
        for item in self._denoise(self.x0_sp, step_fn, sigmas1, video_state, audio_state, "stage1"):
            if isinstance(item, tuple):
                video_state, audio_state = item
            else:
                yield item
        latent1 = tools1.unpatchify(tools1.clear_conditioning(video_state)).latent
        audio_latent = audio_tools.unpatchify(audio_tools.clear_conditioning(audio_state)).latent
        self._stage_end("stage1")

        # ---- upsample (driver) and broadcast -----------------------------------------------------------
        if driver:
            yield stage_event("upsample")
        self._stage_begin()
        tools2 = geo.video_tools(1)
        up = upsample_latent(latent1, self.encoder, self.upsampler) if driver else None
        s2 = tools2.target_shape
        upscaled = self._sync(up, (1, s2.channels, s2.frames, s2.height, s2.width))
        self._stage_end("upsample")

        # ---- stage 2: full resolution (SP for distilled, TDP + distilled LoRA for two-stage) ------------
        if self.tracker is not None:
            self.tracker.apply(self.stage2_loras)  # collective: sharded fusion + broadcast, in place
        self._stage_begin()
        sigmas2 = torch.tensor(self.stage2_sigmas, dtype=torch.float32)
        cond2 = self._conditionings(conditioning_images, tools2)
        video_state = make_state(
            tools2,
            cond2,
            generator=gen,
            noise_scale=float(sigmas2[0]),
            device=self.device,
            dtype=self.dtype,
            initial_latent=upscaled,
        )
        if self.two_stage:  # tiled audio is meaningless: keep stage 1's audio as fixed conditioning
            audio_state = make_state(
                audio_tools,
                [],
                generator=gen,
                noise_scale=0.0,
                device=self.device,
                dtype=self.dtype,
                initial_latent=audio_latent,
                frozen=True,
            )
            x0 = self.x0_tdp
            self.tdp_model.set_latent_shape(s2)
            step_fn = simple_denoise(x0, 1, *pos)
        else:
            audio_state = make_state(
                audio_tools,
                [],
                generator=gen,
                noise_scale=float(sigmas2[0]),
                device=self.device,
                dtype=self.dtype,
                initial_latent=audio_latent,
            )
            x0 = self.x0_sp
            step_fn = simple_denoise(x0, 1, *pos)
        if driver:
            yield stage_event(
                "stage2",
                steps=len(sigmas2) - 1,
                video_tokens=int(video_state.latent.shape[1]),
                mode="tdp" if self.two_stage else "sp",
            )
        for item in self._denoise(x0, step_fn, sigmas2, video_state, audio_state, "stage2"):
            if isinstance(item, tuple):
                video_state, audio_state = item
            else:
                yield item
        latent2 = tools2.unpatchify(tools2.clear_conditioning(video_state)).latent
        self._stage_end("stage2")
        if not bool(torch.isfinite(latent2).all()):  # identical latents on every rank: a symmetric failure
            raise RunnerError("the denoised video latent is not finite (NaN/inf); nothing was written")

        # ---- decode (distributed) and write (driver) ---------------------------------------------------
        if driver:
            yield stage_event("decode")
        self._stage_begin()
        frames = self.decoder.decode_uint8(latent2, seed=int(seed))
        self._stage_end("decode")
        peaks = self._peak_report()
        if not driver:
            return
        yield stage_event("mux")
        size = write_mp4(frames, output_path, geo.frame_rate)
        extra: dict[str, Any] = {
            "seed": int(seed),
            "world_size": self.world_size,
            "prompt": used_prompt,
            "audio": False,
        }
        if peaks is not None:
            extra["peak_memory_bytes"] = peaks
        yield output_event(
            os.fspath(output_path),
            frames=int(frames.shape[0]),
            fps=geo.frame_rate,
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
            size_bytes=size,
            **extra,
        )


def _stage1_guidance(
    overrides: dict[str, dict[str, float]], stg_blocks: tuple[int, ...]
) -> tuple[GuidanceParams, GuidanceParams]:
    """The two-stage runner's stage-1 guidance: the reference's defaults (video CFG 3, audio CFG 7, STG 1,
    rescale 0.7, modality 3) with the setup's overrides per modality; checked at setup on every rank."""
    defaults = {
        "video": GuidanceParams(
            cfg_scale=3.0, stg_scale=1.0, stg_blocks=stg_blocks, rescale_scale=0.7, modality_scale=3.0
        ),
        "audio": GuidanceParams(
            cfg_scale=7.0, stg_scale=1.0, stg_blocks=stg_blocks, rescale_scale=0.7, modality_scale=3.0
        ),
    }
    allowed = {f.name for f in fields(GuidanceParams)} - {"stg_blocks"}
    if set(overrides) - set(defaults):
        raise ValueError(f"stage1_guidance: keys must be 'video' and/or 'audio', got {sorted(overrides)}")
    out = []
    for name, base in defaults.items():
        given = dict(overrides.get(name) or {})
        unknown = set(given) - allowed
        if unknown:
            raise ValueError(f"stage1_guidance[{name!r}]: unknown fields {sorted(unknown)}; allowed {sorted(allowed)}")
        out.append(replace(base, **{k: float(v) for k, v in given.items()}))
    return out[0], out[1]


class Ltx2DistilledRunner(_Ltx2Runner):
    """ "ltx2-distilled": the distilled checkpoint, 8 + 3 steps, no guidance, SP for both stages."""

    two_stage = False

    def __call__(
        self,
        *,
        output_path: str,
        prompt: str,
        negative_prompt: str = "",
        seed: int = 42,
        width: int = 768,
        height: int = 512,
        num_frames: int = 121,
        frame_rate: float = 24.0,
        steps: int | None = None,
        guidance_scale: float | None = None,
        images: list | None = None,
        enhance_prompt: bool = False,
    ) -> Iterator[dict[str, Any]]:
        # The schema's generic fields that the distilled model cannot use are refused, not ignored.
        if negative_prompt:
            raise ValueError("the distilled runner uses no negative prompt (it runs without CFG)")
        if steps is not None:
            raise ValueError("the distilled runner has a fixed schedule (8 + 3 steps); leave steps unset")
        if guidance_scale is not None:
            raise ValueError("the distilled runner runs without guidance; leave guidance_scale unset")
        yield from self._render(
            output_path=output_path,
            prompt=prompt,
            negative_prompt="",
            seed=seed,
            width=width,
            height=height,
            num_frames=num_frames,
            frame_rate=frame_rate,
            steps=len(DISTILLED_SIGMAS) - 1,
            guidance_scale=None,
            images=images,
            enhance_prompt=enhance_prompt,
        )


class Ltx2TwoStageRunner(_Ltx2Runner):
    """ "ltx2-two-stage": the full model with guidance for stage 1 (SP), the distilled LoRA for stage 2 (TDP)."""

    two_stage = True

    def __call__(
        self,
        *,
        output_path: str,
        prompt: str,
        negative_prompt: str = "",
        seed: int = 42,
        width: int = 768,
        height: int = 512,
        num_frames: int = 121,
        frame_rate: float = 24.0,
        steps: int | None = None,
        guidance_scale: float | None = None,
        images: list | None = None,
        enhance_prompt: bool = False,
    ) -> Iterator[dict[str, Any]]:
        if guidance_scale is not None and guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0, got {guidance_scale}")
        yield from self._render(
            output_path=output_path,
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=seed,
            width=width,
            height=height,
            num_frames=num_frames,
            frame_rate=frame_rate,
            steps=self.default_steps if steps is None else int(steps),
            guidance_scale=guidance_scale,
            images=images,
            enhance_prompt=enhance_prompt,
        )
