"""`Ltx2Runner`: what the two LTX-2 runners share (the job's stages, events); see docs/runners.md.

A job is a fixed sequence of stages, each a method a runner may override:

    render(args):  _encode -> _stage1 -> _upsample -> _stage2 -> _decode_video -> _decode_audio -> _mux

(with the placement hooks of `Ltx2Resident` between them: a parked text encoder leaves after `_encode` and comes
back after the decode; a clean copy in host memory starts back after `_stage2`.)

The stages are written once, here; `Ltx2DistilledRunner` (distilled.py) and `Ltx2TwoStageRunner`
(two_stage.py) fill in what differs through small hooks: `_stage1_sigmas` / `_stage1_step` (schedule and
step function: plain or guided), `_stage2_step` (SP or TDP model) / `_stage2_audio` (refine or keep stage
1's audio), `_job_steps` / `_validate_stage2` / `_negative_prompt` (request handling) and the setup hooks
`_stage2_extra_loras` / `_setup_stage2` / `_default_stage2_sigmas`. Every stage method is a generator: it
yields its events (driver only) and *returns* its result, so `render` reads
`result = yield from self._stage1(...)`. Each stage runs inside `self.clock.stage(name)` (wall seconds and
CUDA peak memory between device synchronisations), reported in the `output` event.

The resident models (`setup()`, LoRA fusion, the job's memory plan) are `Ltx2Resident` (resident.py).

Job kwargs: `common.args.RenderArgs` (ltx_contract/schema.py `RenderRequest` + `output_path`). Every request
check runs on every rank before any collective and raises `ValueError` (a recoverable
`SymmetricRunnerError`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...control.events import Stage, output_event, progress_event, stage_event
from ...media.mp4 import AudioTrack, audio_fields
from ...parallel import check_token_budget, padded_token_count
from ...parallel.lora.lora_tracker import LoraSpec
from ...parallel.pipeline.vae_decode import frames_to_uint8, vae_tiles
from ...parallel.sharding.collectives import broadcast_tensor
from ...spec.bounds import check_audio_budget
from ...spec.memory_plan import FleetMemory
from ...spec.placement import STREAMED_ENHANCE_REFUSAL
from ...spec.request_rules import RequestRules
from ..common.args import MEDIA_MODES, RenderArgs, job_entry
from ..common.handoff import FrameStream, deliver_video, stream_video
from ..common.job_loras import job_lora_specs
from ..common.stages import LORA_CHECK, check_finite
from . import spec
from .denoise import (
    Geometry,
    blend_clean,
    build_conditionings,
    encode_images,
    image_latent_shape,
    make_state,
    upsample_latent,
)
from .images import DecodedImage, parse_images
from .resident import Ltx2Resident

__all__ = ["Job", "Ltx2Runner", "Prompt"]

Events = Generator[dict[str, Any], None, Any]  #: a stage: yields events, returns its result


@dataclass(frozen=True)
class Job:
    """One validated render on every rank: the request, its geometry, decoded images, stage-1 steps."""

    args: RenderArgs
    geo: Geometry
    images: list[DecodedImage]
    steps: int  #: stage-1 denoising steps
    generator: torch.Generator  #: CPU noise: the same bits on every rank and device
    loras: tuple[LoraSpec, ...] = ()  #: the request's LoRAs, fused on top of each stage's own (common.job_loras)
    lora_check_s: float = 0.0  #: this rank's header checks of `loras` (before the clock starts: see render())


@dataclass(frozen=True)
class Prompt:
    """Encoded prompts: the text used (after enhancement), (video, audio) contexts, and the negative ones."""

    text: str
    positive: tuple[torch.Tensor, torch.Tensor]
    negative: tuple[torch.Tensor, torch.Tensor] | None


class Ltx2Runner(Ltx2Resident):
    """The shared LTX-2 runner; subclasses set the stage-1/stage-2 behaviour (see the module docstring)."""

    #: stage-1 steps accepted by `_validate` (ltx-core's LTX2Scheduler yields a NaN sigma for a single step)
    min_steps = 1
    media_modes = MEDIA_MODES  #: `media` values a job may take (the worker asks for "stream" when listed)

    @classmethod
    def request_limits(cls, **setup_kwargs: Any) -> dict[str, tuple[float, float]]:
        """The audio length within the SP token budget (what `_validate` enforces on every rank)."""
        return spec.request_limits(cls.memory_kind, setup_kwargs)

    @classmethod
    def request_rules(cls, **setup_kwargs: Any) -> RequestRules:
        """The request rules (`ltx_mgpu.spec.request_rules`) `_job` checks on every rank, published by the worker."""
        return spec.request_rules(cls.memory_kind, setup_kwargs)

    #: the runner kind of the memory plan (`ltx_mgpu.spec.memory_plan`)
    memory_kind = "distilled"

    @classmethod
    def takes_request_loras(cls, **setup_kwargs: Any) -> bool:
        """Only a runner that holds a LoRA tracker fuses request LoRAs (the two-stage one, one with setup
        `loras`, or `request_loras`); the plan's `lora_tracker` is that rule."""
        return cls.memory_fleet(1, **setup_kwargs).has_tracker

    @classmethod
    def memory_fleet(cls, world_size: int, **setup_kwargs: Any) -> FleetMemory:
        """This runner's inputs to the memory plan on `world_size` ranks (no fleet needed): `spec.memory_fleet`."""
        return spec.memory_fleet(cls.memory_kind, world_size, setup_kwargs)

    # =====================================================================================================
    # one job
    # =====================================================================================================
    __call__ = job_entry(RenderArgs)

    def render(self, args: RenderArgs) -> Iterator[dict[str, Any]]:
        """One job on every rank (SPMD); the driver yields the events and writes the file."""
        job = self._job(args)
        self._use_memory_plan(args.memory_plan)
        self._make_graph_room((job.geo.width, job.geo.height, job.geo.num_frames, job.geo.frame_rate), args.memory_plan)
        self.clock.reset()
        if job.loras:  # part of the job's LoRA cost: `lora_swap_*` counts every part of it (a host-only stage)
            self.clock.timings_s[LORA_CHECK] = round(job.lora_check_s, 6)
        prompt = yield from self._encode(job)
        self._park_text()
        self._between_stages()
        video1, audio1 = yield from self._stage1(job, prompt)
        self._between_stages()
        upscaled = yield from self._upsample(job, video1)
        self._between_stages()
        video2, audio2 = yield from self._stage2(job, prompt, upscaled, audio1)
        self._restore_clean_early()
        self._between_stages()
        check_finite(video=video2, audio=audio2)  # identical latents on every rank: a symmetric failure
        if args.media == "stream":  # the frames leave chunk by chunk while the VAE decodes (`common.handoff`)
            streamed = yield from self._stream_video(job, video2)
        else:
            frames = yield from self._decode_video(job, video2)
        self._unpark_text()
        peaks = self.clock.peak_report(self.world_size, self.groups.control_group)  # last collective
        if not self.is_driver:
            return
        track = yield from self._decode_audio(job, audio2)
        if args.media == "stream":
            yield streamed.close_event(track)
            size, shape = 0, (streamed.total, streamed.height, streamed.width)
        else:
            size, shape = (yield from self._mux(job, frames, track)), tuple(frames.shape[:3])
        extra: dict[str, Any] = {"seed": int(args.seed), "world_size": self.world_size, "prompt": prompt.text}
        if self.synthetic:
            extra["synthetic_weights"] = True  # renders from synthetic weights are noise
        if args.memory_plan is not None:
            extra["memory_plan"] = dict(args.memory_plan)
        if peaks is not None:
            reserved = self.clock.reserved_report or {}
            for stage in (Stage.AUDIO_DECODE, Stage.MUX, Stage.HANDOFF):  # driver-only stages, after the gather
                if stage in self.clock.peaks:
                    peaks[stage] = [self.clock.peaks[stage]] + [0] * (self.world_size - 1)
                    reserved[stage] = [self.clock.reserved[stage]] + [0] * (self.world_size - 1)
            extra["peak_memory_bytes"] = peaks
            extra["peak_reserved_bytes"] = reserved  # (what runs out: the plan predicts this one)
        yield output_event(
            os.fspath(args.output_path),
            frames=int(shape[0]),
            fps=job.geo.frame_rate,
            width=int(shape[2]),
            height=int(shape[1]),
            size_bytes=size,
            **extra,
            **audio_fields(track),
            **({"media": args.media} if args.media != "mp4" else {}),
            timings_s=dict(self.clock.timings_s),
            **self.clock.gpu_report(),
        )

    def _job_steps(self, args: RenderArgs) -> int:
        """Stage-1 steps for `args` (refuse fields the runner cannot use here, with `ValueError`)."""
        raise NotImplementedError

    def _job(self, args: RenderArgs) -> Job:
        geo = Geometry(
            int(args.width),
            int(args.height),
            int(args.num_frames),
            float(args.frame_rate),
            self.latent_channels,
            self.audio_channels,
        )
        steps = self._job_steps(args)
        images = parse_images(args.images, geo.num_frames)
        self._validate(geo, steps, args.output_path)
        if args.enhance_prompt and self.placement["text_encoder"] == "stream":  # (the edge refuses it too)
            raise ValueError(STREAMED_ENHANCE_REFUSAL)
        t0 = time.perf_counter()
        loras = job_lora_specs(args.loras, self.lora_targets)  # (every rank, before any collective)
        checked = time.perf_counter() - t0
        return Job(args, geo, images, steps, torch.Generator().manual_seed(int(args.seed)), loras, checked)

    def _validate(self, geo: Geometry, steps: int, output_path: str) -> None:  # every rank, before any collective
        # the size and duration rules the schema, the plan and the producer share (`RequestRuleError`)
        self.rules.check(width=geo.width, height=geo.height, num_frames=geo.num_frames, frame_rate=geo.frame_rate)
        check_audio_budget(geo.num_frames, geo.frame_rate, self.sp_max_tokens)
        if not self.min_steps <= steps <= self.max_steps:
            raise ValueError(f"steps must be in [{self.min_steps}, {self.max_steps}], got {steps}")
        if not output_path:
            raise ValueError("output_path is required")
        # SP budget: the smallest forward (one row) of stage 1 must fit; guidance rows are batched only as far
        # as the budget allows (see `_max_batch`). Stage 2's own limits: `_validate_stage2`.
        check_token_budget(padded_token_count(geo.tokens(2), self.world_size), 1, self.sp_max_tokens)
        self._validate_stage2(geo)
        full = geo.video_tools(1).target_shape
        vae_tiles((1, self.latent_channels, full.frames, full.height, full.width), self.vae_tiling)

    def _validate_stage2(self, geo: Geometry) -> None:
        raise NotImplementedError

    # ---- the stages --------------------------------------------------------------------------------------
    def _encode(self, job: Job) -> Events:
        """Prompt (and the negative prompt, when `_negative_prompt` gives one) -> contexts on every rank."""
        if self.is_driver:
            yield stage_event(Stage.ENCODE)
        with self.clock.stage(Stage.ENCODE):
            self._text_ready()
            prompt = job.args.prompt
            if job.args.enhance_prompt:
                first = next((img.pixels for img in job.images if img.frame == 0), None)
                prompt = self.text.enhance(prompt, image=first, seed=int(job.args.seed))
            negative = self._negative_prompt(job)
            # the negative prompt repeats from job to job (the runner's default): cached on every rank
            encodings = self.text.encode([prompt] if negative is None else [prompt, negative], cacheable=(False, True))

            def contexts(e: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
                return e["video"].to(self.dtype), e["audio"].to(self.dtype)

            neg = contexts(encodings[1]) if negative is not None else None
            return Prompt(prompt, contexts(encodings[0]), neg)

    def _negative_prompt(self, job: Job) -> str | None:
        """The unconditional prompt, or None for runners without CFG."""
        del job
        return None

    def _stage1(self, job: Job, prompt: Prompt) -> Events:
        """Half-resolution denoising of video and audio from noise with the base LoRAs; returns the
        (video latent, audio latent), unpatchified. Runner specifics: `_stage1_sigmas`, `_stage1_step`."""
        tools, audio_tools = job.geo.video_tools(2), job.geo.audio_tools()
        sigmas = self._stage1_sigmas(job)
        self._use_loras(self.base_loras + job.loras, "lora_swap_stage1")
        with self.clock.stage(Stage.STAGE1):
            video = self._state(tools, job, conditionings=self._conditionings(job.images, tools), noise_scale=1.0)
            audio = self._state(audio_tools, job, noise_scale=1.0)
            tokens = int(video.latent.shape[1])
            step, layout = self._stage1_step(job, prompt, self._max_batch(tokens), video, audio)
            if self.is_driver:
                yield stage_event(
                    Stage.STAGE1,
                    steps=len(sigmas) - 1,
                    video_tokens=tokens,
                    world_size=self.world_size,
                    passes=int(getattr(step, "passes", 1)),  # transformer passes per step (guidance)
                    layout=layout,
                )
            video, audio = yield from self._denoise(Stage.STAGE1, step, sigmas, video, audio)
            return (
                tools.unpatchify(tools.clear_conditioning(video)).latent,
                audio_tools.unpatchify(audio_tools.clear_conditioning(audio)).latent,
            )

    def _stage1_sigmas(self, job: Job) -> torch.Tensor:
        raise NotImplementedError

    def _stage1_step(
        self, job: Job, prompt: Prompt, max_batch: int, video: Any, audio: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The stage-1 step function `(video_state, audio_state, sigma) -> (denoised video, denoised audio)`
        for the stage's initial `video`/`audio` states, and the parallel layout it runs under (reported in the
        stage event)."""
        raise NotImplementedError

    def _sp_layout(self) -> dict[str, Any]:
        """The layout report of a stage that runs plain SP over the whole fleet."""
        return {"name": f"1x{self.world_size}", "guidance": 1, "sequence": self.world_size, "source": "sp"}

    def _upsample(self, job: Job, latent: torch.Tensor) -> Events:
        """x2 latent upsampler on the driver, broadcast to every rank."""
        if self.is_driver:
            yield stage_event(Stage.UPSAMPLE)
        with self.clock.stage(Stage.UPSAMPLE):
            up = upsample_latent(latent, self.encoder, self.upsampler) if self.is_driver else None
            s2 = job.geo.video_tools(1).target_shape
            return self._sync(up, (1, s2.channels, s2.frames, s2.height, s2.width))

    def _stage2(self, job: Job, prompt: Prompt, upscaled: torch.Tensor, audio: torch.Tensor) -> Events:
        """Full-resolution refinement of the upscaled latent (re-noised to the first stage-2 sigma) with the
        stage-2 LoRAs; returns (video latent, audio latent). Runner specifics: `_stage2_step` (model, mode)
        and `_stage2_audio` (what happens to stage 1's audio)."""
        tools, audio_tools = job.geo.video_tools(1), job.geo.audio_tools()
        sigmas = torch.tensor(self.stage2_sigmas, dtype=torch.float32)
        sigma0 = float(sigmas[0])
        self._use_loras(self.stage2_loras + job.loras, "lora_swap_stage2")  # collective: sharded fusion, in place
        with self.clock.stage(Stage.STAGE2):
            cond = self._conditionings(job.images, tools)
            video = self._state(tools, job, conditionings=cond, noise_scale=sigma0, initial_latent=upscaled)
            audio_state = self._stage2_audio(job, audio_tools, audio, sigma0)
            step, mode = self._stage2_step(job, prompt, tools.target_shape)
            if self.is_driver:
                tokens = int(video.latent.shape[1])
                yield stage_event(Stage.STAGE2, steps=len(sigmas) - 1, video_tokens=tokens, mode=mode)
            video, audio_state = yield from self._denoise(Stage.STAGE2, step, sigmas, video, audio_state)
            return (
                tools.unpatchify(tools.clear_conditioning(video)).latent,
                audio_tools.unpatchify(audio_tools.clear_conditioning(audio_state)).latent,
            )

    def _stage2_step(self, job: Job, prompt: Prompt, shape: Any) -> tuple[Any, str]:
        """The stage-2 step function and its mode name ("sp" or "tdp") for the full-resolution `shape`."""
        raise NotImplementedError

    def _stage2_audio(self, job: Job, tools: Any, latent: torch.Tensor, sigma0: float) -> Any:
        """Stage 2's audio state: stage 1's audio re-noised to `sigma0` and denoised again with the video."""
        return self._state(tools, job, noise_scale=sigma0, initial_latent=latent)

    def _decode_video(self, job: Job, latent: torch.Tensor) -> Events:
        """Distributed VAE decode (tiles across ranks); uint8 frames on the driver's device, None elsewhere."""
        if self.is_driver:
            yield stage_event(Stage.DECODE)
        with self.clock.stage(Stage.DECODE):
            video = self.decoder.decode(latent, seed=int(job.args.seed))
            return None if video is None else frames_to_uint8(video)  # on the device: yuv420p is made there

    def _stream_video(self, job: Job, latent: torch.Tensor) -> Events:
        """Every rank: the distributed decode chunk by chunk (`decode_chunks`: temporal chunks with the
        decoder's `chunk_tiling`, else one); the driver hands each chunk's final frames off as it comes and
        returns its `FrameStream` (None elsewhere)."""
        stream = None
        if self.is_driver:
            yield stage_event(Stage.DECODE)
            f, h, w = self.decoder.output_shape(tuple(latent.shape))
            stream = FrameStream(frames=f, width=w, height=h, fps=job.geo.frame_rate, device=self.device)
        chunks = self.decoder.decode_chunks(latent, seed=int(job.args.seed))
        yield from stream_video(self.clock, stream, (None if v is None else frames_to_uint8(v) for v in chunks))
        return stream

    def _decode_audio(self, job: Job, latent: torch.Tensor) -> Events:
        """Driver only: audio latent -> stereo waveform fitted to the video's duration (None if not asked)."""
        if not job.args.audio:
            return None
        assert self.audio is not None  # built on the driver
        yield stage_event(Stage.AUDIO_DECODE)
        with self.clock.stage(Stage.AUDIO_DECODE):
            return self.audio.decode(latent).fitted(job.args.duration_s)

    def _mux(self, job: Job, frames: torch.Tensor, track: AudioTrack | None) -> Events:
        """Driver only: H.264 (+ AAC) mp4 at the output path, or the frames handed off (`media="frames"`,
        `common.handoff`); returns the file's size in bytes (0 for a hand-off)."""
        return (yield from deliver_video(self.clock, job.args, frames, job.geo.frame_rate, track))

    # =====================================================================================================
    # helpers for the stages
    # =====================================================================================================
    def _sync(self, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank 0's tensor on every rank (the driver computed it; others pass None)."""
        if tensor is None:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        tensor = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        return broadcast_tensor(tensor, 0, self.groups.transformer_group) if self.world_size > 1 else tensor

    def _max_batch(self, tokens: int) -> int:
        return max(1, self.sp_max_tokens // padded_token_count(tokens, self.world_size))

    def _conditionings(self, images: list[DecodedImage], tools: Any) -> list:
        """Image latents encoded on the driver, broadcast, turned into conditioning items on every rank."""
        if not images:
            return []
        latents = encode_images(images, tools, self.encoder) if self.is_driver else [None] * len(images)
        shape = image_latent_shape(tools)
        return build_conditionings(images, [self._sync(lat, shape) for lat in latents])

    def _state(self, tools: Any, job: Job, **kwargs: Any) -> Any:
        return make_state(
            tools,
            kwargs.pop("conditionings", []),
            generator=job.generator,
            device=self.device,
            dtype=self.dtype,
            **kwargs,
        )

    def _denoise(
        self, stage: str, step_fn: Any, sigmas: torch.Tensor, video_state: Any, audio_state: Any
    ) -> Generator[dict[str, Any], None, tuple[Any, Any]]:
        """Euler loop with one cancellation check (no collective) per step; yields progress on the driver and
        returns the final (video_state, audio_state)."""
        from dataclasses import replace

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
        return video_state, audio_state
