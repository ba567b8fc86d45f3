"""`Ltx2Resident`: the models an LTX-2 rank keeps resident between jobs, and how a job changes them.

`setup()` (once per rank) builds the resident state every job of `Ltx2Runner` (base.py) uses: the SP
transformer behind its attention router and CUDA-graph wrapper, the LoRA tracker that fuses LoRAs into those
weights in place, the distributed VAE decoder (every rank), the encoder, upsampler and audio decoding (the
driver), and the prompt encoder. A job changes that state only through `_use_loras` (fuse exactly a job's
LoRAs), `_use_memory_plan` (the worker's plan: chunked decode, releasing the allocator cache between stages,
parking the text encoder), `_between_stages` and the placement hooks `_text_ready`, `_park_text`,
`_unpark_text` and `_restore_clean_early`.

Placement (setup `placement`, `ltx_mgpu.spec.placement`, chosen by the worker before the fleet loads): the LoRA
tracker's clean copy and the setup LoRAs' factors in GPU or pinned host memory, and a text encoder that may be
parked in pinned host memory by a job whose plan needs its room.

The runners fill in the stage-2 models through the setup hooks `_stage2_extra_loras`, `_setup_stage2` and
`_default_stage2_sigmas`.

Setup kwargs (every rank; the table is in docs/runners.md): `checkpoint_path` (the LTX-2 monolith),
`spatial_upsampler_path`, `gemma_root`, `distilled_lora_path` (two-stage), and the tuning options of `setup`.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from ...control.memory_report import live_memory_report
from ...control.runner import MGPURunner
from ...parallel import CudaGraphForward, LayerDims, LayoutPolicy
from ...parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker
from ...parallel.pipeline.tiling import BalancedTiling
from ...spec.memory_plan import sp_tokens
from ...spec.memory_profile import MAX_CAPTURE_TOKEN_ROWS
from ..common.audio import AudioDecoding, build_audio_decoding
from ..common.graph_room import GraphRoom
from ..common.job_loras import model_targets
from ..common.loading import build_checked, build_sp_transformer, warn_if_synthetic
from ..common.stages import SetupLaps, StageClock, apply_memory_cap
from . import components as comp
from . import spec

__all__ = ["Ltx2Resident"]

log = logging.getLogger("ltx_mgpu.runners.ltx2")


class Ltx2Resident(MGPURunner):
    """An LTX-2 rank's resident models (see the module docstring); `Ltx2Runner` adds the job's stages."""

    memory_kind: ClassVar[str]  #: the runner kind of the memory plan (set by `Ltx2Runner` and its runners)
    #: Gemma's modeling code (transformers pulls in its generation utilities and torch._dynamo): 7-13 s of
    #: imports measured on the rank that holds the text encoder, now overlapped with the transformer load
    background_imports = ("transformers.models.gemma3.modeling_gemma3", "ltx_core.text_encoders.gemma")

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
        sp_max_tokens: int | None = spec.SETUP_DEFAULTS["sp_max_tokens"],
        sp_backend: str = "auto",
        tdp_tiles: int | None = None,
        tdp_overlap: int = 2,
        vae_tiles: int | None = None,
        vae_overlap: int = spec.SETUP_DEFAULTS["vae_overlap"],
        vae_chunked: bool = False,
        vae_chunk_frames: int = 0,
        text_encoder: str = "source",
        text_encoder_rank: int | None = None,
        prompt_tokens: int = 1024,
        enhance_max_new_tokens: int = 512,
        default_steps: int | None = None,
        max_steps: int = spec.SETUP_DEFAULTS["max_steps"],
        stage2_sigmas: list[float] | None = None,
        stg_blocks: list[int] | None = None,
        stage1_guidance: dict[str, dict[str, float]] | None = None,
        parallel_layout: str | dict[str, str] | None = None,
        cuda_graphs: bool = True,
        request_loras: bool = False,
        lora_device_cache_gib: float = spec.SETUP_DEFAULTS["lora_device_cache_gib"],
        fused_elementwise: bool = False,
        placement: dict[str, str] | None = None,
    ) -> None:
        self.placement = spec.placement({"placement": placement})  # (every rank, before anything loads)
        apply_memory_cap(self.device)  # (a smaller card emulated: benchmarks only, `LTX_MGPU_MEMORY_CAP_GIB`)
        self.dtype = comp.parse_dtype(dtype)
        policy = comp.quantization_policy(quantization)
        if policy is not None and self.dtype != torch.bfloat16:
            raise ValueError("quantized transformers run in bfloat16: set dtype='bfloat16'")
        comp.check_gpu(quantization, self.device)
        from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

        self.base_loras = tuple(LoraSpec(str(p), float(s), LTXV_LORA_COMFY_RENAMING_MAP) for p, s in loras)
        self.stage2_loras = self.base_loras + self._stage2_extra_loras(distilled_lora_path, distilled_lora_strength)
        if (self.stage2_loras or request_loras) and policy is None and self.dtype != torch.bfloat16:
            raise ValueError("LoRA fusion (ltx-core apply_loras) needs bfloat16 or fp8 weights: set dtype='bfloat16'")
        self.max_steps = int(max_steps)
        self.rules = spec.request_rules(self.memory_kind, {"max_steps": self.max_steps})
        # the SP budget: the setting, else what the largest request the rules accept needs (`memory_plan.sp_tokens`,
        # the same function the plan counts the buffers with)
        self.sp_max_tokens = sp_tokens(
            spec.memory_fleet(
                self.memory_kind, self.world_size, {"sp_max_tokens": sp_max_tokens, "stage1_guidance": stage1_guidance}
            )
        )
        self.synthetic = warn_if_synthetic(checkpoint_path, announce=self.is_driver)
        self.clock = StageClock(self.device)
        laps = SetupLaps(self.device)

        # ---- transformer: one resident SP model per rank --------------------------------------------------
        laps.lap("prepare")
        tb = comp.transformer_builder(checkpoint_path, quantization=policy)
        tcfg = tb.model_config()["transformer"]
        self.latent_channels = int(tcfg["in_channels"])
        self.audio_channels = int(tcfg["audio_in_channels"])
        self.num_layers = int(tcfg["num_layers"])
        build_dtype = None if policy is not None else self.dtype  # quantized weights keep their fp8 dtype
        # an AttentionRouter over every G x S layout (groups made once, here): guidance-parallel stages run
        # the same resident model under smaller SP groups (docs/sequence-parallel.md, "Layouts")
        self.attention, self.sp_model = build_sp_transformer(
            tb,
            self,
            max_tokens=self.sp_max_tokens,
            dtype=self.dtype,
            backend=sp_backend,
            build_dtype=build_dtype,
            layouts=True,
            laps=laps,
        )
        comp.check_quantized(self.sp_model.model, quantization)
        if fused_elementwise:  # norms, modulation, gated residuals and split RoPE as Triton kernels (ltx_mgpu.fused)
            from ltx_mgpu.fused.block import fuse_elementwise

            fuse_elementwise(self.sp_model.model)
        from ltx_core.model.transformer import X0Model

        self.x0_sp = X0Model(self.sp_model)
        self.layout_policy = LayoutPolicy(
            parallel_layout, world_size=self.world_size, dims=LayerDims.from_config(tcfg), layers=self.num_layers
        )
        # every SP forward of a denoising stage goes through the graph wrapper: captured per (layout, shape)
        # on CUDA and replayed (eager on CPU, for shapes seen once, or where a capture fails)
        self.x0_graphed = CudaGraphForward(
            self.x0_sp,
            enabled=bool(cuda_graphs),
            key_fn=lambda: self.attention.active_layout,
            capturable=self.attention.capture_blocker,
            agree=self.attention.all_agree,
            max_capture_rows=MAX_CAPTURE_TOKEN_ROWS * self.world_size,  # (the wrapper sees the whole sequence)
        )
        self.graph_room = GraphRoom()
        options = {
            "tdp_tiles": tdp_tiles,
            "tdp_overlap": int(tdp_overlap),
            "default_steps": default_steps,
            "stage1_guidance": stage1_guidance,
        }
        self._setup_stage2(tb, checkpoint_path=checkpoint_path, stg_blocks=stg_blocks, **options)
        laps.lap("stage2_models")
        self.stage2_sigmas = tuple(float(s) for s in (stage2_sigmas or self._default_stage2_sigmas()))
        if len(self.stage2_sigmas) < 2 or self.stage2_sigmas[-1] != 0.0:
            raise ValueError(f"stage2_sigmas must have >= 2 values and end at 0.0, got {self.stage2_sigmas}")

        # ---- LoRAs: the tracker keeps weights resident and swaps them in place ----------------------------
        self.tracker = None
        self.lora_targets = None  # the weights a request LoRA may change (None: requests take no LoRAs)
        if self.stage2_loras or request_loras:
            if not 0.0 <= float(lora_device_cache_gib) < 1024:
                raise ValueError(f"lora_device_cache_gib must be in [0, 1024), got {lora_device_cache_gib}")
            cache_bytes = int(float(lora_device_cache_gib) * (1 << 30))  # past jobs' LoRA factors, per rank
            from ..common.fast_load import StagedSafetensorsLoader

            host = {k: "cpu" if self.placement[k] == "host" else None for k in ("lora_backup", "lora_factors")}
            self.tracker = LoraWeightTracker(
                self.groups.transformer_group,
                device_cache_bytes=cache_bytes,
                factor_reader=StagedSafetensorsLoader().read_tensors,
                backup_device=host["lora_backup"],
                factor_device=host["lora_factors"],
            )
            self.tracker.attach(self.sp_model.model)
            self.tracker.apply(self.base_loras)
            self.lora_targets = model_targets(self.sp_model.model)
        laps.lap("loras")

        # ---- VAE: decoder on every rank (tiles); encoder, upsampler, audio decoding on the driver ---------
        self.vae_tiling = BalancedTiling(max(1, int(vae_tiles or self.world_size)), overlap=int(vae_overlap))
        self.decoder = comp.distributed_video_decoder(
            checkpoint_path,
            self.groups.vae_group,
            self.vae_tiling,
            vae_chunked,
            self.device,
            self.dtype,
            chunk_frames=int(vae_chunk_frames),
        )
        self.setup_chunk_tiling = self.decoder.chunk_tiling  # a job's memory plan may chunk more, never less
        self.release_between_stages = False
        laps.lap("video_decoder")
        self.encoder = self.upsampler = None
        self.audio: AudioDecoding | None = None
        if self.is_driver:
            self.encoder = build_checked(
                comp.video_encoder_builder(checkpoint_path), self.device, self.dtype, "video encoder"
            )
            self.upsampler = build_checked(
                comp.upsampler_builder(spatial_upsampler_path), self.device, self.dtype, "spatial upsampler"
            )
            # float32: the audio models are small (~0.1 B parameters) and bf16 would be audible in the waveform
            self.audio = build_audio_decoding(checkpoint_path, self.device, torch.float32)
            laps.lap("driver_models")

        # ---- prompt encoder: Gemma on one rank (broadcast) or on every rank (batch-parallel) ------------
        self.await_background_imports()
        from .text import build_prompt_encoder

        self.text = build_prompt_encoder(
            self,
            text_encoder,
            text_encoder_rank,
            gemma_root=gemma_root,
            checkpoint=checkpoint_path,
            dtype=self.dtype,
            max_tokens=int(prompt_tokens),
            enhance_max_new_tokens=int(enhance_max_new_tokens),
            stream=self.placement["text_encoder"] == "stream",
        )
        self.parkable_text = None  # this rank's Gemma with a pinned mirror (`placement["text_encoder"] == "park"`)
        local = getattr(self.text, "encoder", None)
        if self.placement["text_encoder"] == "park" and local is not None:
            from ..common.host_tier import ParkableWeights

            self.parkable_text = ParkableWeights(local.text_encoder, self.device)
        self.park_this_job = False
        laps.lap("text_encoder")
        # what loading cached and no longer holds (the fp8 conversion's bf16 originals, the staged loader's
        # buffers) goes back: left, it sat under the first job's encode (57.9 GiB reserved over 51.0 allocated
        # on an H100, fp8 distilled), the one stage the plan under-predicted (by 9.6%)
        self.clock.release()
        self.setup_phases_s = laps.phases_s
        self.setup_memory_gib = laps.memory_gib

    # ---- hooks for the runners -------------------------------------------------------------------------
    def _stage2_extra_loras(self, path: str | None, strength: float) -> tuple[LoraSpec, ...]:
        """LoRAs fused for stage 2 on top of the base ones (the two-stage runner's distilled LoRA)."""
        del path, strength
        return ()

    def _setup_stage2(self, tb: Any, **options: Any) -> None:
        """Stage-2 models and runner options (the two-stage runner builds its TDP sibling here)."""
        del tb, options

    def _default_stage2_sigmas(self) -> tuple[float, ...]:
        raise NotImplementedError

    def _use_memory_plan(self, plan: dict[str, Any] | None) -> None:
        """The worker's memory plan for this job (`ltx_mgpu.spec.memory_plan`; the same on every rank): `decode_chunked`
        decodes each tile in ltx-core's default chunks (the reference CLI's decode tiling), and
        `release_between_stages` hands the allocator cache back after each stage. None: setup's choices."""
        plan = plan or {}
        chunk = self.setup_chunk_tiling
        if plan.get("decode_chunked") and (chunk is None or chunk.spatial_config is None):
            from ltx_core.model.video_vae import TilingConfig

            chunk = TilingConfig.default()
        self.decoder.chunk_tiling = chunk
        self.release_between_stages = bool(plan.get("release_between_stages"))
        self.park_this_job = bool(plan.get("park_text_encoder"))  # (every rank: the graphs are dropped on all)

    def _make_graph_room(self, size: tuple[Any, ...], plan: dict[str, Any] | None) -> None:
        """Before a job: drop the CUDA graphs of other sizes when the plan has no room for their pools
        (`GraphRoom`; the same decision on every rank)."""
        if self.graph_room.before_job(size, plan):  # (the ledger now holds this job's size: it captures next)
            self._release_graphs()

    def _drop_graphs(self) -> None:
        """Every CUDA graph and its pool, handed back to the device, and the ledger emptied."""
        self._release_graphs()
        self.graph_room.clear()

    def _release_graphs(self) -> None:
        self.x0_graphed.reset()
        self.clock.release()

    def _between_stages(self) -> None:
        if self.release_between_stages:
            self.clock.release()

    # ---- placement: a parked text encoder, the clean weights back early -----------------------------------
    def _text_ready(self) -> None:
        """Before an encode: the text encoder on its GPU (back from a job that failed while it was parked), and
        the stream ordered after a copy still in flight."""
        if self.parkable_text is not None:
            self.parkable_text.unpark()
            self.parkable_text.ensure()

    def _park_text(self) -> None:
        """After the encode of a job whose plan parks it: drop the text encoder's GPU copy (its pinned mirror
        stays) and hand the memory back, so the denoise and the decode have the room."""
        if self.park_this_job and self.parkable_text is not None:
            self.parkable_text.park()
            self.clock.release()

    def _unpark_text(self) -> None:
        """After the decode of a job that parked the text encoder (every rank: symmetric): drop the CUDA graphs
        (their private pool would otherwise stay beside the returning encoder, and a large job's pool is
        large), hand the memory back, and start the encoder's copy back (a side stream: it runs beside the
        driver's audio decode and the hand-off; the next encode waits for it)."""
        if not self.park_this_job:
            return
        with self.clock.stage("unpark"):
            self._drop_graphs()
            if self.parkable_text is not None:
                try:
                    self.parkable_text.unpark()
                except torch.OutOfMemoryError as exc:  # the video is made: the next encode copies it back
                    log.warning(
                        "the text encoder stays parked until the next encode (its copy back found no room "
                        "while this job's tensors were alive): %s; what holds the device: %s",
                        str(exc).splitlines()[0][:300],
                        live_memory_report(self.device),
                    )

    def _restore_clean_early(self) -> None:
        """After the last stage that uses LoRAs differing from stage 1's: with the clean copy in host memory on
        one GPU, start restoring it beside the decode (`LoraWeightTracker.reset_async`); elsewhere the next
        job's stage-1 swap restores it, as before."""
        host = self.placement["lora_backup"] == "host"
        if self.tracker is not None and host and self.world_size == 1 and self.stage2_loras != self.base_loras:
            self.tracker.reset_async()

    def _use_loras(self, loras: tuple[LoraSpec, ...], stage: str) -> None:
        """Collective: fuse exactly `loras` into the resident weights (a no-op when already so), timed as
        its own stage (the two-stage runner swaps twice a job)."""
        if self.tracker is not None:
            with self.clock.stage(stage):
                self.tracker.apply(loras, keep_factors=self.stage2_loras)  # a past job's factors: freed first
