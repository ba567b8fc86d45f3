"""The render request: one validated pydantic model shared by the producer (edge) and the worker (job).

Imports neither torch nor ltx_mgpu, so the producer CLI stays light. Limits here are structural (what any
LTX-2 runner accepts); per-runner limits (e.g. a token budget) are checked again in the runner, identically
on every rank, so a request that slips past the edge still fails cleanly without hurting the fleet.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["MAX_PROMPT_CHARS", "RenderRequest"]

MAX_PROMPT_CHARS = 4000
SPATIAL_MULTIPLE = 32  # the video VAE downsamples height and width by 32
TEMPORAL_MULTIPLE = 8  # ... and time by 8 (after the first frame): num_frames = 8k + 1


class RenderRequest(BaseModel):
    """One video to render. Unknown fields are rejected so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    width: int = Field(default=768, ge=32, le=2048)
    height: int = Field(default=512, ge=32, le=2048)
    num_frames: int = Field(default=121, ge=1, le=257)
    frame_rate: float = Field(default=24.0, gt=0, le=120)
    steps: int | None = Field(default=None, ge=1, le=200, description="denoising steps; runner default if unset")
    guidance_scale: float | None = Field(default=None, ge=1.0, le=20.0)
    enhance_prompt: bool = False

    @field_validator("width", "height")
    @classmethod
    def _spatial_multiple(cls, value: int) -> int:
        if value % SPATIAL_MULTIPLE:
            raise ValueError(f"must be a multiple of {SPATIAL_MULTIPLE}, got {value}")
        return value

    @field_validator("num_frames")
    @classmethod
    def _temporal_multiple(cls, value: int) -> int:
        if (value - 1) % TEMPORAL_MULTIPLE:
            raise ValueError(f"must be {TEMPORAL_MULTIPLE}k+1 (1, 9, 17, ..., 257), got {value}")
        return value

    def runner_kwargs(self) -> dict[str, Any]:
        """The job kwargs for a runner: unset optional fields are left out so runner defaults apply."""
        return self.model_dump(exclude_none=True)
