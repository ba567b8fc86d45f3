"""The job arguments of a render, declared once.

`RenderArgs` is what a render job carries: the fields of the service's request schema
(`ltx_contract/schema.py RenderRequest`, checked against this class by a test) plus `output_path`. A runner
family with other defaults subclasses it and redeclares only those fields.

`job_entry(RenderArgs)` makes a runner's `__call__` from it: `runner(**job)` builds the dataclass and
hands it to `runner.render(args)`. The function carries an explicit `inspect.Signature` made from the
dataclass, because the controller binds job kwargs against `inspect.signature(runner_cls.__call__)` in the
caller (a typo is a `TypeError` there, never a dead fleet): the signature must list every field.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...spec.bounds import RANGES, check_numbers

__all__ = ["MEDIA_MODES", "RenderArgs", "job_entry", "job_signature"]

#: how the video leaves the fleet (`common.handoff`): written as an mp4, handed off whole, or handed off
#: while it decodes
MEDIA_MODES = ("mp4", "frames", "stream")


@dataclass(frozen=True, kw_only=True)
class RenderArgs:
    """One render job (defaults: LTX-2's default request, 768x512, 121 frames at 24 fps)."""

    output_path: str  #: where the driver rank writes the mp4
    prompt: str
    negative_prompt: str = ""
    seed: int = 42
    width: int = 768
    height: int = 512
    num_frames: int = 121
    frame_rate: float = 24.0
    steps: int | None = None  #: denoising steps; None = the runner's default
    guidance_scale: float | None = None  #: None = the runner's default
    images: list | None = None  #: conditioning images [{"data": base64, "frame", "strength"}], ltx2 runners
    enhance_prompt: bool = False
    audio: bool = True  #: decode and mux the audio track; False = a silent mp4 and no audio decode
    #: "mp4": the driver writes the mp4 at output_path; "frames": it yields a `media` event (yuv420p frames
    #: and the waveform, `ltx_mgpu.media.mp4.media_event`) instead and writes nothing, so the caller encodes them
    #: while the fleet takes its next job (not a request field: the worker sets it); "stream": the same hand-off
    #: while the VAE decodes (`common.handoff.FrameStream`: the encoder starts on the first decoded frames)
    media: str = "mp4"
    loras: list | None = None  #: [{"path", "strength"}]: request LoRAs the worker resolved and checked
    #: the worker's memory plan for this job (`ltx_mgpu.spec.memory_plan.MemoryPlan.job_kwargs`: `decode_chunked`,
    #: `release_between_stages`); not a request field. None: the runner's setup decides (the fast plan)
    memory_plan: dict | None = None

    def __post_init__(self) -> None:
        # The request schema validated these at the edge; a job that reached a rank another way is checked
        # again here, identically on every rank (a recoverable ValueError, never a truthy "false").
        for name in ("audio", "enhance_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.memory_plan is not None and not isinstance(self.memory_plan, dict):
            raise ValueError(f"memory_plan must be an object, got {type(self.memory_plan).__name__}")
        if self.media not in MEDIA_MODES:
            raise ValueError(f"media must be one of {', '.join(map(repr, MEDIA_MODES))}, got {self.media!r}")
        # Every number inside the service's ranges (`ltx_mgpu.spec.bounds`): finite, of its type, bounded.
        check_numbers(**{name: getattr(self, name) for name in RANGES if hasattr(self, name)})

    @property
    def duration_s(self) -> float:
        """The video's length in seconds (the audio track is fitted to it)."""
        return float(self.num_frames) / float(self.frame_rate)


def job_signature(args_type: type[RenderArgs]) -> inspect.Signature:
    """`(self, *, <every field of args_type>)` with its defaults and annotations."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(args_type):
        default = f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return inspect.Signature(params, return_annotation="Iterator[dict[str, Any]]")


def job_entry(args_type: type[RenderArgs]) -> Callable[..., Iterator[dict[str, Any]]]:
    """A runner `__call__` (a generator) that builds `args_type(**job)` and yields from `self.render(args)`."""

    def __call__(self: Any, **job: Any) -> Iterator[dict[str, Any]]:
        yield from self.render(args_type(**job))

    __call__.__signature__ = job_signature(args_type)  # type: ignore[attr-defined]
    __call__.__doc__ = f"Run one job: keyword arguments are the fields of `{args_type.__name__}`."
    return __call__
