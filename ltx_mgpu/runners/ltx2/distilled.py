"""`Ltx2DistilledRunner` ("ltx2-distilled"): the distilled LTX-2 checkpoint, 8 + 3 steps, no guidance.

Both stages run the one resident transformer under sequence parallelism (SP): stage 1 from noise with the
distilled model's 8-sigma schedule, stage 2 on the x2-upscaled latent with the 3-step refinement schedule.
The audio latent is refined in stage 2 along with the video (SP computes it untiled on every rank, so it
stays meaningful). The request fields the distilled model cannot use (a negative prompt, steps, guidance)
are refused, never ignored.
"""

from __future__ import annotations

from typing import Any

import torch

from ...parallel import check_token_budget, padded_token_count
from ..common.args import RenderArgs
from .base import Job, Ltx2Runner, Prompt
from .denoise import DISTILLED_SIGMAS, STAGE2_DISTILLED_SIGMAS, Geometry, simple_denoise

__all__ = ["Ltx2DistilledRunner"]


class Ltx2DistilledRunner(Ltx2Runner):
    """ "ltx2-distilled": the distilled checkpoint, 8 + 3 steps, no guidance, SP for both stages."""

    def _default_stage2_sigmas(self) -> tuple[float, ...]:
        return STAGE2_DISTILLED_SIGMAS

    def _job_steps(self, args: RenderArgs) -> int:
        # a negative prompt, steps, guidance_scale: refused by the rules (`RequestRuleError`, invalid_request)
        self.rules.check(negative_prompt=args.negative_prompt, steps=args.steps, guidance_scale=args.guidance_scale)
        return len(DISTILLED_SIGMAS) - 1

    def _validate_stage2(self, geo: Geometry) -> None:
        check_token_budget(padded_token_count(geo.tokens(1), self.world_size), 1, self.sp_max_tokens)

    def _stage1_sigmas(self, job: Job) -> torch.Tensor:
        del job
        return torch.tensor(DISTILLED_SIGMAS, dtype=torch.float32)

    def _setup_stage2(self, tb: Any, *, stage1_guidance: dict | None = None, **options: Any) -> None:
        del tb, options
        if stage1_guidance:
            raise ValueError("the distilled runner runs without guidance: stage1_guidance does not apply")

    def _stage1_step(
        self, job: Job, prompt: Prompt, max_batch: int, video: Any, audio: Any
    ) -> tuple[Any, dict[str, Any]]:
        del job, video, audio
        return simple_denoise(self.x0_graphed, max_batch, *prompt.positive), self._sp_layout()

    def _stage2_step(self, job: Job, prompt: Prompt, shape: Any) -> tuple[Any, str]:
        del job, shape
        return simple_denoise(self.x0_graphed, 1, *prompt.positive), "sp"
