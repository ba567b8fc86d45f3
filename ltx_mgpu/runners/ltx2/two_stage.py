"""`Ltx2TwoStageRunner` ("ltx2-two-stage"): the full LTX-2 model with multi-modal guidance for stage 1 (SP),
the distilled LoRA for stage 2 (tiled data parallel, TDP).

Stage 1 runs `steps` steps of ltx-core's LTX2Scheduler at half resolution with CFG (negative prompt), STG
(perturbed self-attention in `stg_blocks`), rescale and modality isolation, batching the guidance passes
through SP as far as the token budget allows. The step function is built in ONE place, `_stage1_step`
(the pass list and the guider combine live in `denoise.guided_denoise`), so a different execution of the
same step (e.g. guidance passes on separate rank groups) can replace it without touching anything else.

Stage 2 runs a weight-sharing sibling of the resident transformer through the TDP wrapper, with the
distilled LoRA fused in place by the LoRA tracker (and taken out again before the next stage 1). Audio in
stage 2 is refined with the video as in the single-device reference (re-noised to the first stage-2 sigma
and denoised again), from the TDP wrapper's tile-averaged audio predictions: tiles split height and width
only, so every tile's forward sees every frame, and the average lands within 0.6% of the full-view
refinement where keeping stage 1's audio stays 93% away from it (docs/runners.md, "Audio").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...control.events import Stage
from ...parallel import GuidanceParallelPasses
from ...parallel.layouts.layout import layout_groups
from ...parallel.lora.lora_tracker import LoraSpec
from ...parallel.pipeline.tdp import TiledDataParallelBuilder
from ...parallel.pipeline.tiling import BalancedTiling
from ...parallel.sp.builder import SP_MODULE_OPS_NAME
from ..common.args import RenderArgs
from ..common.loading import checkpoint_metadata
from . import spec
from .base import Job, Ltx2Runner, Prompt
from .denoise import (
    STAGE2_DISTILLED_SIGMAS,
    STAGE2_TDP_SIGMAS,
    Geometry,
    GuidanceParams,
    guided_denoise,
    run_passes,
    simple_denoise,
)

__all__ = ["AUDIO_GUIDANCE", "DEFAULT_NEGATIVE_PROMPT", "VIDEO_GUIDANCE", "Ltx2TwoStageRunner"]

DEFAULT_NEGATIVE_PROMPT = (
    "blurry, out of focus, low resolution, noisy, distorted, deformed, watermark, text, flicker, jitter, "
    "washed out colors, bad anatomy, static frame, muted or distorted audio"
)
#: Stage-1 guidance for video, the reference's LTX-2 defaults: CFG 3 against the negative prompt, STG 1 on
#: `stg_blocks`, rescale 0.7 toward the conditional prediction, modality isolation 3. A request's
#: `guidance_scale` replaces `cfg_scale`.
VIDEO_GUIDANCE = GuidanceParams(**spec.VIDEO_GUIDANCE)
#: Stage-1 guidance for audio: the same, with CFG 7.
AUDIO_GUIDANCE = GuidanceParams(**spec.AUDIO_GUIDANCE)
#: Default stage-1 steps and STG block per checkpoint family (LTX-2.0 / LTX-2.3).
DEFAULT_STEPS, DEFAULT_STEPS_2_3 = 40, 30
STG_BLOCK, STG_BLOCK_2_3 = 29, 28


class Ltx2TwoStageRunner(Ltx2Runner):
    """ "ltx2-two-stage": guided stage 1 (SP), distilled-LoRA stage 2 (TDP); see the module docstring."""

    min_steps = 2  # ltx-core's LTX2Scheduler yields a NaN sigma for a single step
    memory_kind = "two-stage"

    # ---- setup hooks ------------------------------------------------------------------------------------
    def _stage2_extra_loras(self, path: str | None, strength: float) -> tuple[LoraSpec, ...]:
        if not path:
            raise ValueError("the two-stage runner needs distilled_lora_path (stage 2 runs with the distilled LoRA)")
        from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

        return (LoraSpec(str(path), float(strength), LTXV_LORA_COMFY_RENAMING_MAP),)

    def _setup_stage2(
        self,
        tb: Any,
        *,
        tdp_tiles: int | None,
        tdp_overlap: int,
        checkpoint_path: str,
        default_steps: int | None,
        stg_blocks: list[int] | None,
        stage1_guidance: dict[str, dict[str, float]] | None,
    ) -> None:
        from ltx_core.model.transformer import X0Model

        tiles = max(self.world_size, int(tdp_tiles or self.world_size))
        self.tdp_tiling = BalancedTiling(tiles, overlap=tdp_overlap)
        tdp = TiledDataParallelBuilder(tb, tiling=self.tdp_tiling, group=self.groups.transformer_group)
        self.tdp_model = tdp.build_sharing(self.sp_model.model, drop_module_ops=[SP_MODULE_OPS_NAME])
        self.x0_tdp = X0Model(self.tdp_model)
        # defaults from the checkpoint's model version (LTX-2.0 vs 2.3)
        v23 = str(checkpoint_metadata(checkpoint_path).get("model_version", "")).startswith("2.3")
        self.default_steps = int(default_steps or (DEFAULT_STEPS_2_3 if v23 else DEFAULT_STEPS))
        blocks = (
            stg_blocks if stg_blocks is not None else [min(STG_BLOCK_2_3 if v23 else STG_BLOCK, self.num_layers - 1)]
        )
        if any(not 0 <= int(b) < self.num_layers for b in blocks):
            raise ValueError(f"stg_blocks {blocks} outside the transformer's {self.num_layers} blocks")
        self.stg_blocks = tuple(int(b) for b in blocks)
        self.stage1_guidance = stage1_guidance_params(stage1_guidance or {}, self.stg_blocks)

    def _default_stage2_sigmas(self) -> tuple[float, ...]:
        # tiles drift apart more the noisier they start: a lower first sigma when there really are tiles
        return STAGE2_TDP_SIGMAS if self.world_size > 1 else STAGE2_DISTILLED_SIGMAS

    # ---- job ---------------------------------------------------------------------------------------------
    def _job_steps(self, args: RenderArgs) -> int:
        if args.guidance_scale is not None and args.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0, got {args.guidance_scale}")
        self.rules.check(steps=args.steps)  # [min_steps, max_steps] (`RequestRuleError`, invalid_request)
        return self.default_steps if args.steps is None else int(args.steps)

    def _validate_stage2(self, geo: Geometry) -> None:
        shape = geo.video_tools(1).target_shape
        self.tdp_tiling.grid_for((shape.frames, shape.height, shape.width))  # raises if it cannot tile

    def _negative_prompt(self, job: Job) -> str | None:
        return job.args.negative_prompt or DEFAULT_NEGATIVE_PROMPT

    def _stage1_sigmas(self, job: Job) -> torch.Tensor:
        from ltx_core.components.schedulers import LTX2Scheduler

        shape = job.geo.video_tools(2).target_shape
        probe = torch.empty((1, shape.channels, shape.frames, shape.height, shape.width), device="meta")
        return LTX2Scheduler().execute(steps=job.steps, latent=probe).to(torch.float32)

    def _stage1_step(
        self, job: Job, prompt: Prompt, max_batch: int, video: Any, audio: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The guided stage-1 step: conditional, negative-prompt, STG-perturbed and modality-isolated passes
        (as the guidance asks), spread over G rank groups x S SP ranks (guidance parallelism; the layout
        from the cost model or the `parallel_layout` override), combined per modality by ltx-core's guider."""
        video_guidance, audio_guidance = self.stage1_guidance
        if job.args.guidance_scale is not None:  # the request's scale is the video CFG scale
            video_guidance = dataclasses.replace(video_guidance, cfg_scale=float(job.args.guidance_scale))
        assert prompt.negative is not None  # `_negative_prompt` always gives one here
        audio_tokens, context_tokens = int(audio.latent.shape[1]), int(prompt.positive[0].shape[1])
        graphed = self.x0_graphed.enabled and self.device.type == "cuda"

        def choose(tokens: int, passes: int) -> Any:
            return self.layout_policy.choose(
                Stage.STAGE1,
                tokens=tokens,
                passes=passes,
                audio_tokens=audio_tokens,
                context_tokens=context_tokens,
                graphed=graphed,
            )

        runner = GuidanceParallelPasses(
            layout_groups(self),
            self.attention,
            run_passes,
            choose=choose,
            max_tokens=self.sp_max_tokens,
            device=self.device,
        )
        step = guided_denoise(
            self.x0_graphed,
            max_batch,
            positive=prompt.positive,
            negative=prompt.negative,
            video=video_guidance,
            audio=audio_guidance,
            run=runner,
        )
        return step, runner.plan(int(video.latent.shape[1]), step.passes).describe()

    def _stage2_step(self, job: Job, prompt: Prompt, shape: Any) -> tuple[Any, str]:
        del job
        self.tdp_model.set_latent_shape(shape)
        return simple_denoise(self.x0_tdp, 1, *prompt.positive), "tdp"


def stage1_guidance_params(
    overrides: dict[str, dict[str, float]], stg_blocks: tuple[int, ...]
) -> tuple[GuidanceParams, GuidanceParams]:
    """Stage-1 guidance (video, audio): `VIDEO_GUIDANCE` / `AUDIO_GUIDANCE` on `stg_blocks`, with the setup
    kwarg `stage1_guidance`'s fields per modality replacing them (e.g. CFG only, 2 passes a step:
    `{"video": {"stg_scale": 0, "modality_scale": 1, "rescale_scale": 0}, "audio": {...}}`). Checked at
    setup on every rank: unknown modalities or fields are a `ValueError`."""
    defaults = {"video": VIDEO_GUIDANCE, "audio": AUDIO_GUIDANCE}
    allowed = {f.name for f in dataclasses.fields(GuidanceParams)} - {"stg_blocks"}
    if set(overrides) - set(defaults):
        raise ValueError(f"stage1_guidance: keys must be 'video' and/or 'audio', got {sorted(overrides)}")
    out = []
    for name, base in defaults.items():
        given = dict(overrides.get(name) or {})
        unknown = set(given) - allowed
        if unknown:
            raise ValueError(f"stage1_guidance[{name!r}]: unknown fields {sorted(unknown)}; allowed {sorted(allowed)}")
        fields = {k: float(v) for k, v in given.items()}
        out.append(dataclasses.replace(base, stg_blocks=stg_blocks, **fields))
    return out[0], out[1]
