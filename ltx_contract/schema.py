"""The render request: one validated pydantic model shared by the producer (edge) and the worker (job).

Imports no torch, so the producer CLI stays light; of the engine only `ltx_mgpu.spec.bounds` and
`ltx_mgpu.spec.request_rules` (stdlib only), where the numeric ranges and the size rules live that the runners check
again on every rank. Limits here are structural (`request_rules.GENERIC`: what any LTX-2 runner accepts);
per-runner rules (multiples of 64, fields a runner refuses, the clip's duration, steps, the memory plan) are
published by each worker (`ltx_contract.limits`) and checked again in the runner, identically on every
rank, so a request that slips past the edge still fails cleanly without hurting the fleet.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ltx_contract.lora_refs import MAX_LORAS, LoraRef, strength_problem
from ltx_mgpu.spec.bounds import FLOAT_FIELDS, RANGES
from ltx_mgpu.spec.image_size import IMAGE_FORMATS, MAX_IMAGE_SIDE, image_size
from ltx_mgpu.spec.request_rules import GENERIC

__all__ = ["MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_PROMPT_CHARS", "ConditioningImage", "RenderRequest"]

MAX_PROMPT_CHARS = 4000
SPATIAL_MULTIPLE = GENERIC.spatial_multiple  # the video VAE downsamples height and width by 32
TEMPORAL_MULTIPLE = GENERIC.temporal_multiple  # ... and time by 8 (after the first frame): num_frames = 8k + 1
MAX_IMAGES = 4  #: conditioning images per request
MAX_IMAGE_BYTES = 8 << 20  #: decoded size of one image file (the request travels through Redis as JSON)


def _bounds(name: str) -> dict[str, Any]:
    """Field constraints from `ltx_mgpu.spec.bounds` (the runners check the same ranges on every rank); floats
    must be finite (JSON files may say `NaN` or `Infinity`)."""
    low, high = RANGES[name]
    if name in FLOAT_FIELDS:
        return {"ge": low, "le": high, "allow_inf_nan": False}
    return {"ge": int(low), "le": int(high)}


class ConditioningImage(BaseModel):
    """An image the video is conditioned on, carried inline so the request never names a worker path.

    `data` is a base64-encoded PNG, JPEG, WebP, GIF or BMP file (`ltx_mgpu.spec.image_size` reads its size from the
    header; any other format is refused, since its size could not be checked before decoding); `frame` the
    video frame it pins (0, or a
    multiple of 8: one latent frame); `strength` how strongly (1.0 = keep the image exactly).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field(min_length=4, max_length=4 * ((MAX_IMAGE_BYTES + 2) // 3), repr=False)
    frame: int = Field(default=0, **_bounds("frame"))
    strength: float = Field(default=1.0, **_bounds("strength"))

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"must be base64-encoded image bytes: {exc}") from exc
        if len(raw) > MAX_IMAGE_BYTES:
            raise ValueError(f"image is {len(raw)} bytes, over the {MAX_IMAGE_BYTES} byte limit")
        size = image_size(raw)  # (from the header: nothing is decoded here)
        if size is None:  # a format the size check cannot read would reach the decoder unchecked: refuse it
            raise ValueError(f"not a {IMAGE_FORMATS} file (the formats whose size is checked before decoding)")
        if max(size[1], size[2]) > MAX_IMAGE_SIDE:
            raise ValueError(f"{size[0]} image of {size[1]}x{size[2]} pixels; at most {MAX_IMAGE_SIDE} per side")
        return value

    @field_validator("frame")
    @classmethod
    def _latent_frame(cls, value: int) -> int:
        if value % TEMPORAL_MULTIPLE:
            raise ValueError(f"must be 0 or a multiple of {TEMPORAL_MULTIPLE} (a latent frame), got {value}")
        return value


class RenderRequest(BaseModel):
    """One video to render. Unknown fields are rejected so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    seed: int = Field(default=42, **_bounds("seed"))
    width: int = Field(default=768, **_bounds("width"))
    height: int = Field(default=512, **_bounds("height"))
    num_frames: int = Field(default=121, **_bounds("num_frames"))
    frame_rate: float = Field(default=24.0, **_bounds("frame_rate"), description="frames per second, 1 to 120")
    steps: int | None = Field(default=None, **_bounds("steps"), description="denoising steps; runner default if unset")
    guidance_scale: float | None = Field(default=None, **_bounds("guidance_scale"))
    enhance_prompt: bool = False
    images: list[ConditioningImage] | None = Field(
        default=None, max_length=MAX_IMAGES, description="image conditioning (ltx2 runners); None = text only"
    )
    audio: bool = Field(
        default=True, description="decode the generated audio into the mp4 (AAC); false = a silent mp4, faster"
    )
    loras: list[LoraRef] | None = Field(
        default=None, max_length=MAX_LORAS, description="LoRAs fused for this job only (ltx_contract.lora_refs)"
    )

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
            raise ValueError(f"must be {TEMPORAL_MULTIPLE}k+1 (1, 9, 17, ..., {GENERIC.max_frames}), got {value}")
        return value

    @model_validator(mode="after")
    def _size_rules(self) -> RenderRequest:
        """What no runner renders (`request_rules.GENERIC`: e.g. more pixels a frame than 4K); each runner
        publishes narrower rules (`ltx_contract.limits`)."""
        if (problem := GENERIC.size_problem(self.width, self.height, self.num_frames)) is not None:
            raise ValueError(
                problem.replace(" (runner 'any')", "").replace(" runner 'any' renders", " any runner renders")
            )
        return self

    @model_validator(mode="after")
    def _images_inside_the_video(self) -> RenderRequest:
        for i, image in enumerate(self.images or ()):
            if image.frame >= self.num_frames:
                raise ValueError(f"images[{i}].frame {image.frame} is past the last frame ({self.num_frames - 1})")
        return self

    @model_validator(mode="after")
    def _lora_strength_per_file(self) -> RenderRequest:
        if self.loras and (problem := strength_problem((r.label, r.strength) for r in self.loras)):
            raise ValueError(f"loras: {problem}")
        return self

    def runner_kwargs(self) -> dict[str, Any]:
        """The job kwargs for a runner: unset optional fields are left out so runner defaults apply."""
        return self.model_dump(exclude_none=True)
