"""The memory plan of one request on one fleet, decided before any GPU work (docs/memory.md).

From the fleet's layout (world size, which rank holds Gemma), the runner (distilled or two-stage, its
stage-1 passes and SP token budget), the request's size, the model profile (bytes of each component) and the
memory each device offers (measured after warm-up, or a setting), `plan()` says what stays resident on each
rank, what is released between stages, how the video decode is tiled, the predicted peak of every stage on
the worst rank, and whether the request fits. `largest()` finds the largest size that still fits (for the
refusal's message). A request that does not fit is refused by the worker (and by `producer submit`, from the
limits the worker publishes: `FleetMemory.to_json`) as a request error before it reaches the fleet.

Stdlib only, like `ltx_mgpu.spec.bounds`: the producer imports it (held by tests/test_import_contracts.py).

The model (every figure in GiB = 2**30 bytes; which numbers are calibrated and which derived: docs/memory.md):
- resident: the transformer and the video decoder on every rank (SP keeps the whole model on each); the
  video encoder, the x2 upsampler and the audio decoder on the driver (rank 0); Gemma on one rank (the last,
  unless `text_encoder_rank` says otherwise); wherever a LoRA tracker is set up (two-stage, setup `loras`,
  `request_loras`): its clean backup of every LoRA-able weight (sharded ~1/W), its broadcast staging buffer
  (W > 1), the factors of the setup's LoRAs (sharded like the weights) and of the largest request LoRAs the
  worker admits (`lora_parts`, "LoRAs" in docs/memory.md); on W > 1 the SP exchange buffers (a rank's
  share, ceil(T / W) tokens, of the token budget T: `sp_tokens`); a runtime share (workspaces) calibrated on
  one H200.
- per stage, on top: a transformer forward holds `token_bytes` per (token x row) of its shard and
  `audio_token_bytes` per audio latent x row (unsharded: duration = frames / frame_rate); the upsampler
  `upsample_bytes` per full-resolution latent cell; the decode `decode_bytes` per pixel-frame it decodes at
  once (the driver also holds the blended float32 video and its uint8 frames: `frame_bytes` per pixel-frame,
  and decodes the audio: `audio_decode_bytes_per_s` per second of clip).
- CUDA graphs: each captured forward keeps its private pool (`graph_pool_bytes` per token-row, its fp8 figure
  with the fp8 recipe) from its capture in its own stage to the end of the job, so stage 1's pool is held
  through stage 2 and the decode, and stage 2's through the decode; a forward over `MAX_CAPTURE_TOKEN_ROWS`
  token-rows a rank is never captured (eager, no pool). Graphs of other sizes are the runner's to drop: it
  keeps them only while `job_kwargs()["graph_room_gib"]` has room for them (`GraphRoom`).
- sizes: `ltx_mgpu.spec.request_rules` (the runner's rules) decides which sizes exist at all; a size they refuse
  never fits, and `largest()` suggests only sizes they accept.
- the allocator caches above its peak (`cache_fraction`): the predicted reservation is what must fit.
The decode is the peak at the sizes people ask for; when the plain decode (one spatial tile per rank, the
whole clip at once, the fastest) does not fit, the plan decodes each tile in ltx-core's default chunks
(`TilingConfig.default()`: 512 px tiles with 64 px overlap, 64 frames with 24 overlap: the reference CLI's
own decode tiling) and empties the allocator cache between stages: the lower-memory plan, also the one an
out-of-memory retry takes. The plain decode is also ruled out where its largest tensor would pass 32-bit
indexing (`DECODE_ELEMENTS_PER_PIXEL`): torch refuses such a convolution input whatever memory is free.

Over 450 lines: the model, its refusals and the largest-size search are one calculation over one set of
figures, and splitting them would put the figures in one module and their only reader in another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ltx_mgpu.spec.bounds import audio_latents
from ltx_mgpu.spec.memory_loras import lora_figures, lora_parts, with_lora_limits
from ltx_mgpu.spec.memory_profile import LTX2_19B, MAX_CAPTURE_TOKEN_ROWS, PROFILES, TINY, ModelProfile
from ltx_mgpu.spec.request_rules import RequestRules, ltx2_rules

__all__ = [
    "DEFAULT_FRAME_RATE",
    "DEFAULT_HEADROOM_GIB",
    "DEFAULT_REQUEST_LORAS",
    "PROFILES",
    "FleetMemory",
    "MemoryPlan",
    "ModelProfile",
    "StagePeak",
    "graph_pools",
    "largest",
    "lora_figures",
    "lora_parts",
    "parse_size",
    "plan",
    "sp_tokens",
    "variants",
    "with_lora_limits",
]
_ = (LTX2_19B, TINY)  # (re-exported: `memory_plan.LTX2_19B`, `memory_plan.TINY`)

GIB = float(1 << 30)
DEFAULT_FRAME_RATE = 24.0  #: the request schema's default
DEFAULT_HEADROOM_GIB = 4.0  #: kept free on every device beyond the predicted reservation
#: ltx-core `TilingConfig.default()` chunk of the lower-memory decode: 512 px tiles, 64 frames (+ overlaps)
CHUNK_PIXELS = 512 * 512
CHUNK_FRAMES = 64
#: elements of the plain decode's largest tensor (the padded input of the VAE decoder's last Conv3d) per
#: pixel-frame of a rank's tile: 3.10e9 bf16 elements (5.77 GiB) at 1536x1024x241 on one H200, where torch
#: raised "input tensor must fit into 32-bit index math"; a tenth of the limit is kept as margin
DECODE_ELEMENTS_PER_PIXEL = 8.2
INDEX_LIMIT = 0.9 * 2**31
SPATIAL_SCALE, TEMPORAL_SCALE = 32, 8  #: LTX-2's video VAE: one latent cell per 32x32 px, 8 frames
STAGES = ("encode", "stage1", "upsample", "stage2", "decode")
UINT8_FRAME_BYTES = 3  #: the driver's decoded frames (uint8 RGB) per pixel-frame, held until they leave the device
SUGGESTION_MARGIN = 0.02  #: of the capacity, kept free beyond the headroom by the sizes `largest()` suggests
DEFAULT_REQUEST_LORAS = 4  #: a runner set up with `request_loras`, until the worker says its own (`with_lora_limits`)


RUNNER_KINDS = ("distilled", "two-stage")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def parse_size(text: str) -> tuple[int, int, int]:
    """ "WxHxF" -> (width, height, num_frames); `ValueError` otherwise."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"size must be WIDTHxHEIGHTxFRAMES (e.g. 1536x1024x121), got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


@dataclass(frozen=True)
class FleetMemory:
    """Everything `plan()` needs besides the request: what a worker publishes (`to_json`)."""

    runner: str  #: "distilled" or "two-stage"
    world_size: int
    profile: str = "ltx2-19b"
    text_encoder_rank: int | None = None  #: None: the last rank
    gemma_every_rank: bool = False  #: setup `text_encoder="batch-parallel"`: Gemma on every rank
    fp8_transformer: bool = False  #: setup `quantization="fp8-*"`: the recipe's block weights in float8
    passes: int = 1  #: transformer passes per stage-1 step (guidance: CFG 2, the reference's 4)
    sp_max_tokens: int | None = None  #: the runner's SP token budget; None: sized by `sp_tokens` (the default)
    vae_overlap: int = 1  #: latent cells shared by neighbouring decode tiles (setup `vae_overlap`)
    lora_tracker: bool | None = None  #: the runner holds a LoRA tracker; None: the two-stage one does (older workers)
    setup_lora_gib: float | None = None  #: the setup's LoRA files (GiB); None: two-stage, the profile's distilled LoRA
    request_loras: int = 0  #: LoRAs one request may bring (worker `lora_max_per_request`; 0: none)
    lora_max_file_bytes: int = 4 << 30  #: worker `lora_max_file_bytes`
    lora_max_rank: int = 256  #: worker `lora_max_rank`
    lora_device_cache_gib: float = 0.0  #: setup `lora_device_cache_gib`: past request LoRAs' factors, per rank
    capacity_gib: float | None = None  #: what one device offers this fleet's rank; None: no limit
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    #: placement (`ltx_mgpu.spec.placement`): "gpu" resident, "park" a pinned host mirror, parked per job,
    #: "stream" its layers in pinned host memory, copied in one ahead of their use at every encode
    text_encoder_at: str = "gpu"
    lora_backup_at: str = "gpu"  #: "host": the tracker's clean copy in pinned host memory
    lora_factors_at: str = "gpu"  #: "host": the setup LoRAs' kept factors in pinned host memory

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_KINDS:
            raise ValueError(f"runner must be one of {RUNNER_KINDS}, got {self.runner!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        # (read back from Redis by every producer: bounded, so a bad snapshot cannot make a plan loop for ever)
        _check_int("world_size", self.world_size, 1, 4096)
        _check_int("passes", self.passes, 1, 64)
        if self.sp_max_tokens is not None:
            _check_int("sp_max_tokens", self.sp_max_tokens, 1, 1 << 24)
        _check_int("vae_overlap", self.vae_overlap, 0, 64)
        _check_int("request_loras", self.request_loras, 0, 64)
        _check_int("lora_max_file_bytes", self.lora_max_file_bytes, 1, 1 << 50)
        _check_int("lora_max_rank", self.lora_max_rank, 1, 1 << 20)
        if self.lora_tracker is not None and not isinstance(self.lora_tracker, bool):
            raise ValueError(f"lora_tracker must be a boolean or null, got {self.lora_tracker!r}")
        if self.text_encoder_rank is not None:
            _check_int("text_encoder_rank", self.text_encoder_rank, 0, self.world_size - 1)
        for name, allowed in (
            ("text_encoder_at", ("gpu", "park", "stream")),
            ("lora_backup_at", ("gpu", "host")),
            ("lora_factors_at", ("gpu", "host")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, value in (
            ("capacity_gib", self.capacity_gib),
            ("headroom_gib", self.headroom_gib),
            ("setup_lora_gib", self.setup_lora_gib),
            ("lora_device_cache_gib", self.lora_device_cache_gib),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def has_tracker(self) -> bool:
        return self.runner == "two-stage" if self.lora_tracker is None else self.lora_tracker

    @property
    def rules(self) -> RequestRules:
        """The size rules of this fleet's runner (`ltx_mgpu.spec.request_rules`)."""
        return ltx2_rules(self.runner)

    @property
    def gemma_rank(self) -> int:
        return self.world_size - 1 if self.text_encoder_rank is None else int(self.text_encoder_rank)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def placement(self) -> dict[str, str]:
        """Where the movable components live (`ltx_mgpu.spec.placement`), the runners' setup kwarg `placement`."""
        return {
            "text_encoder": self.text_encoder_at,
            "lora_backup": self.lora_backup_at,
            "lora_factors": self.lora_factors_at,
        }

    @classmethod
    def from_json(cls, data: Any) -> FleetMemory | None:
        """What a worker published; None when missing or malformed (an older worker: nothing to check)."""
        if not isinstance(data, Mapping):
            return None
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True)
class StagePeak:
    """The predicted peak of one stage on its worst rank (GiB)."""

    stage: str
    rank: int
    allocated_gib: float
    reserved_gib: float  #: allocated plus the allocator's cache: what must fit


@dataclass(frozen=True)
class MemoryPlan:
    """One request on one fleet: see the module docstring. `job_kwargs()` is what the runner is told."""

    fleet: FleetMemory
    size: tuple[int, int, int]
    resident_gib: dict[int, dict[str, float]]  #: rank -> component -> GiB
    decode_chunked: bool  #: each tile in ltx-core's default chunks (the lower-memory decode)
    release_between_stages: bool  #: empty the allocator cache after each stage (the lower-memory plan)
    decode_tiles: int  #: spatial tiles, one per rank
    stages: tuple[StagePeak, ...]
    token_problem: str | None = None  #: the SP token budget refuses this size (memory aside)
    rule_problem: str | None = None  #: the runner's size rules refuse this size (`request_rules`)
    frame_rate: float = DEFAULT_FRAME_RATE
    notes: tuple[str, ...] = field(default=())
    park_text_encoder: bool = False  #: the text encoder's GPU copy is dropped after the encode, back after the decode
    graph_pool_gib: float = 0.0  #: this request's CUDA-graph pools on a rank (`graph_pools`), counted in `stages`

    @property
    def is_lowest(self) -> bool:
        """No plan lower in memory exists for this request on this fleet (an out-of-memory retry has nowhere to go)."""
        parked = self.park_text_encoder or self.fleet.text_encoder_at != "park"
        return self.decode_chunked and self.release_between_stages and parked

    @property
    def peak(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.reserved_gib)

    @property
    def limit_gib(self) -> float | None:
        cap = self.fleet.capacity_gib
        return None if cap is None else max(0.0, cap - self.fleet.headroom_gib)

    @property
    def fits(self) -> bool:
        limit = self.limit_gib
        ok = self.token_problem is None and self.rule_problem is None
        return ok and (limit is None or self.peak.reserved_gib <= limit)

    @property
    def low_memory(self) -> bool:
        return self.decode_chunked or self.release_between_stages or self.park_text_encoder

    def job_kwargs(self) -> dict[str, Any]:
        """The runner's `memory_plan` job kwarg."""
        out = {
            "decode_chunked": self.decode_chunked,
            "release_between_stages": self.release_between_stages,
            "predicted_peak_gib": round(self.peak.reserved_gib, 2),
        }
        if self.park_text_encoder:
            out["park_text_encoder"] = True
        limit = self.limit_gib
        # what the runner may keep of other sizes' CUDA graphs beside this job (`GraphRoom`): the plan's room
        out["graph_pool_gib"] = round(self.graph_pool_gib, 3)
        out["graph_room_gib"] = None if limit is None else round(max(0.0, limit - self.peak.reserved_gib), 3)
        return out

    def refusal(self) -> str | None:
        """Why this request cannot run on this fleet (None if it fits)."""
        if self.rule_problem is not None:
            return self.rule_problem
        if self.token_problem is not None:
            return self.token_problem
        if self.fits:
            return None
        w, h, f = self.size
        peak = self.peak
        return (
            f"{w}x{h}x{f} needs {peak.reserved_gib:.1f} GiB on rank {peak.rank} at stage {peak.stage} "
            f"(with the lower-memory plan), over this fleet's limit of {self.limit_gib:.1f} GiB per device "
            f"({self.fleet.capacity_gib:.1f} GiB less {self.fleet.headroom_gib:g} GiB headroom, "
            f"{self.fleet.world_size} GPU(s), {self.fleet.runner})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet.to_json(),
            "size": "x".join(map(str, self.size)),
            "fits": self.fits,
            "limit_gib": self.limit_gib,
            "resident_gib": {str(r): v for r, v in self.resident_gib.items()},
            "decode": {"tiles": self.decode_tiles, "overlap": self.fleet.vae_overlap, "chunked": self.decode_chunked},
            "release_between_stages": self.release_between_stages,
            "token_problem": self.token_problem,
            "rule_problem": self.rule_problem,
            "frame_rate": self.frame_rate,
            "sp_tokens": sp_tokens(self.fleet),
            "stages": [asdict(s) for s in self.stages],
            "peak": asdict(self.peak),
            "park_text_encoder": self.park_text_encoder,
            "placement": self.fleet.placement,
            "notes": list(self.notes),
        }


# ==== the plan ==============================================================================================


def _resident(fleet: FleetMemory, p: ModelProfile) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    transformer = p.transformer_gib
    if fleet.fp8_transformer:  # the recipe's layers in e4m3 + scales, the rest bf16 (derived, not measured)
        transformer += p.lora_weights_fp8_gib - p.lora_weights_gib
    for rank in range(fleet.world_size):
        parts = {"transformer": transformer, "video_decoder": p.video_decoder_gib, "runtime": p.runtime_gib}
        if fleet.world_size > 1:  # (one rank exchanges nothing: no buffers)
            parts["sp_buffers"] = math.ceil(sp_tokens(fleet) / fleet.world_size) * p.sp_buffer_bytes / GIB
        if rank == 0:
            parts.update(video_encoder=p.video_encoder_gib, upsampler=p.upsampler_gib, audio=p.audio_gib)
        if rank == fleet.gemma_rank or fleet.gemma_every_rank:
            streamed = fleet.text_encoder_at == "stream" and p.text_encoder_streamed_gib > 0
            parts["text_encoder"] = p.text_encoder_streamed_gib if streamed else p.text_encoder_gib
        parts.update(lora_parts(fleet, p))  # (the worst rank's share, counted on every rank)
        if fleet.runner == "two-stage":
            parts["two_stage_extra"] = p.two_stage_extra_gib
        out[rank] = {k: round(v, 3) for k, v in parts.items()}
    return out


def _tokens(width: int, height: int, frames: int, scale: int) -> int:
    cell = SPATIAL_SCALE * scale
    return (width // cell) * (height // cell) * ((frames - 1) // TEMPORAL_SCALE + 1)


def _padded(tokens: int, world: int) -> int:
    return tokens + (-tokens) % world


def needed_tokens(fleet: FleetMemory, width: int, height: int, num_frames: int) -> int:
    """The SP token budget a request needs to run its forwards whole: stage 1's rows (every guidance pass
    batched) and the distilled runner's stage 2 (SP over the whole clip; the two-stage runner tiles it)."""
    need = fleet.passes * _padded(_tokens(width, height, num_frames, 2), fleet.world_size)
    if fleet.runner == "distilled":
        need = max(need, _padded(_tokens(width, height, num_frames, 1), fleet.world_size))
    return need


def sp_tokens(fleet: FleetMemory) -> int:
    """The fleet's SP token budget: the setup's `sp_max_tokens`, else (the default) what the largest request
    the runner's rules accept needs (`needed_tokens`), so every size the plan admits also runs. The runner
    sizes its exchange buffers with this same function (`Ltx2Runner.setup`); they cost memory only on W > 1,
    ceil(budget / W) tokens a rank, and the plan counts them."""
    if fleet.sp_max_tokens is not None:
        return int(fleet.sp_max_tokens)
    rules = fleet.rules
    return needed_tokens(fleet, *rules.largest_frame(), rules.max_frames)


def _token_problem(fleet: FleetMemory, size: tuple[int, int, int]) -> str | None:
    """What the runners' own SP budget check refuses (`check_token_budget`): stage 1 with one row, and the
    distilled runner's stage 2 (SP over the whole clip; the two-stage runner tiles stage 2 instead)."""
    w, h, f = size
    budget = sp_tokens(fleet)
    checks = [("stage 1", _padded(_tokens(w, h, f, 2), fleet.world_size))]
    if fleet.runner == "distilled":
        checks.append(("stage 2", _padded(_tokens(w, h, f, 1), fleet.world_size)))
    for stage, tokens in checks:
        if tokens > budget:
            return (
                f"{w}x{h}x{f}: {stage} has {tokens} video tokens, over the runner's SP token budget "
                f"(setup sp_max_tokens={budget})"
            )
    return None


def _stage_peaks(
    fleet: FleetMemory,
    p: ModelProfile,
    size: tuple[int, int, int],
    resident: dict[int, dict[str, float]],
    chunked: bool,
    frame_rate: float,
    park: bool = False,
) -> tuple[StagePeak, ...]:
    """The worst rank of every stage. `park`: the text encoder's GPU copy is gone from stage 1 to the decode and
    comes back after it (`unpark`: resident again, the job's CUDA graphs dropped first; the driver's frames are
    still on its device)."""
    w, h, f = size
    world = fleet.world_size
    t1, t2, rows = _forward_tokens(fleet, size)
    audio = audio_latents(f, frame_rate)  # (every rank holds the whole audio sequence)
    pool1, pool2 = graph_pools(fleet, p, rows * t1, t2)
    token_bytes = (p.fp8_token_bytes or p.token_bytes) if fleet.fp8_transformer else p.token_bytes
    pixels = w * h * f
    tile_pixels = math.ceil(w * h / world) * f  # one spatial tile per rank
    decoded_at_once = min(math.ceil(w * h / world), CHUNK_PIXELS) * min(f, CHUNK_FRAMES) if chunked else tile_pixels
    activations = {
        "encode": lambda rank: p.encode_gib * GIB if _holds_gemma(fleet, rank) else 0.0,
        "stage1": lambda rank: pool1 + token_bytes * rows * t1 / world + p.audio_token_bytes * rows * audio,
        "upsample": lambda rank: pool1 + (p.upsample_bytes * _tokens(w, h, f, 1) if rank == 0 else 0.0),
        "stage2": lambda rank: pool1 + pool2 + token_bytes * t2 / world + p.audio_token_bytes * audio,
        "decode": lambda rank: (
            pool1
            + pool2
            + p.decode_bytes * decoded_at_once
            + (p.frame_bytes * pixels + p.audio_decode_bytes_per_s * f / frame_rate if rank == 0 else 0.0)
        ),
        "unpark": lambda rank: UINT8_FRAME_BYTES * pixels if rank == 0 else 0.0,
    }
    peaks = []
    for stage in (*STAGES, "unpark") if park else STAGES:
        worst: StagePeak | None = None
        for rank, parts in resident.items():
            held = sum(parts.values())
            if park and stage not in ("encode", "unpark") and _holds_gemma(fleet, rank):
                held -= parts.get("text_encoder", 0.0)
            allocated = held + activations[stage](rank) / GIB
            peak = StagePeak(stage, rank, round(allocated, 2), round(allocated * (1 + p.cache_fraction), 2))
            if worst is None or peak.reserved_gib > worst.reserved_gib:
                worst = peak
        assert worst is not None
        peaks.append(worst)
    return tuple(peaks)


def graph_pools(fleet: FleetMemory, p: ModelProfile, rows1: int, t2: int) -> tuple[float, float]:
    """The private pools (bytes, a rank) of stage 1's and stage 2's captured forwards (`rows1` token-rows, `t2`
    tokens, whole sequence): each is held from its capture, during its own stage, to the end of the job (and
    after, until the runner drops the graphs: `GraphRoom`); a forward over `MAX_CAPTURE_TOKEN_ROWS` a rank runs
    eager and holds none."""
    per_row = (p.fp8_graph_pool_bytes or p.graph_pool_bytes) if fleet.fp8_transformer else p.graph_pool_bytes
    world = fleet.world_size
    stage1, stage2 = (per_row * n / world if n / world <= MAX_CAPTURE_TOKEN_ROWS else 0.0 for n in (rows1, t2))
    return stage1, stage2


def _rule_problem(fleet: FleetMemory, size: tuple[int, int, int], frame_rate: float) -> str | None:
    """Every size and duration rule the request breaks (`request_rules`: what the schema, `--dry-run` and the
    runner check), in one message; None when it breaks none."""
    w, h, f = size
    found = [m for _, m in fleet.rules.problems({"width": w, "height": h, "num_frames": f, "frame_rate": frame_rate})]
    return "; ".join(found) or None


def _holds_gemma(fleet: FleetMemory, rank: int) -> bool:
    return rank == fleet.gemma_rank or fleet.gemma_every_rank


def plan(
    fleet: FleetMemory,
    width: int,
    height: int,
    num_frames: int,
    *,
    low_memory: bool = False,
    frame_rate: float = DEFAULT_FRAME_RATE,
) -> MemoryPlan:
    """The plan for one request: the first of `variants()` that fits (or the first when nothing limits the
    fleet). The last is the lower-memory plan; `low_memory` takes it (an out-of-memory retry). `frame_rate`
    sets the clip's duration, so its audio. `fits` says whether the chosen one fits (and the runner's size
    rules accept the size)."""
    tried = variants(fleet, width, height, num_frames, frame_rate=frame_rate)
    if low_memory:
        tried = tried[-1:]
    # (memory decides here; a size the rules refuse keeps the first plan that fits in memory, and says why)
    chosen = next((v for v in tried if v.limit_gib is None or v.peak.reserved_gib <= v.limit_gib), tried[-1])
    notes = list(chosen.notes)
    if not low_memory:  # (why this plan and not the fast one: an out-of-memory retry says so itself)
        if _over_index(fleet, chosen.size):
            notes.append("a one-piece decode would pass 32-bit indexing: the decode runs in ltx-core's default chunks")
        elif chosen.decode_chunked:
            notes.append("the fast plan does not fit: the decode runs in ltx-core's default chunks")
        if chosen.park_text_encoder:
            notes.append("the text encoder is parked in host memory from stage 1 to the decode (its room is needed)")
    return replace(chosen, notes=tuple(notes))


def _over_index(fleet: FleetMemory, size: tuple[int, int, int]) -> bool:
    """The one-piece decode's largest tensor would pass 32-bit indexing (torch refuses it, whatever is free)."""
    return math.ceil(size[0] * size[1] / fleet.world_size) * size[2] * DECODE_ELEMENTS_PER_PIXEL > INDEX_LIMIT


def variants(
    fleet: FleetMemory, width: int, height: int, num_frames: int, *, frame_rate: float = DEFAULT_FRAME_RATE
) -> list[MemoryPlan]:
    """Every plan a runner can take for one request, in the order `plan()` tries them: the fast plan; the chunked
    decode (ltx-core's default chunks, the cache released between stages); with a parkable text encoder
    (`text_encoder_at="park"`) the same two with it parked (its copy back costs its bytes over the host link,
    measured dearer than the chunks at 768x512). Without the fast decode where it would pass 32-bit indexing.
    `bench.plan_check --variants` renders each, to measure what the order assumes."""
    p = PROFILES[fleet.profile]
    size = (int(width), int(height), int(num_frames))
    frame_rate = float(frame_rate) if frame_rate and frame_rate > 0 else DEFAULT_FRAME_RATE
    resident = _resident(fleet, p)
    notes = []
    if fleet.world_size > 1 and fleet.gemma_rank == 0 and not fleet.gemma_every_rank:
        notes.append("Gemma shares the driver rank with the encoder, upsampler and audio: a later rank has room")
    pairs = [(False, False), (True, False)] + ([(False, True), (True, True)] if fleet.text_encoder_at == "park" else [])
    if _over_index(fleet, size):
        pairs = [pair for pair in pairs if pair[0]]
    token_problem, rule_problem = _token_problem(fleet, size), _rule_problem(fleet, size, frame_rate)
    return [
        MemoryPlan(
            fleet,
            size,
            resident,
            decode_chunked=chunked,
            release_between_stages=chunked,
            decode_tiles=fleet.world_size,
            stages=_stage_peaks(fleet, p, size, resident, chunked=chunked, frame_rate=frame_rate, park=park),
            token_problem=token_problem,
            rule_problem=rule_problem,
            frame_rate=frame_rate,
            notes=tuple(notes),
            park_text_encoder=park,
            graph_pool_gib=_job_pools(fleet, p, size),
        )
        for chunked, park in pairs
    ]


def _job_pools(fleet: FleetMemory, p: ModelProfile, size: tuple[int, int, int]) -> float:
    """This request's CUDA-graph pools on a rank (GiB): stage 1's rows x tokens and stage 2's tokens."""
    t1, t2, rows = _forward_tokens(fleet, size)
    return sum(graph_pools(fleet, p, rows * t1, t2)) / GIB


def _forward_tokens(fleet: FleetMemory, size: tuple[int, int, int]) -> tuple[int, int, int]:
    """Stage 1's and stage 2's video tokens (padded to the world size) and stage 1's guidance rows batched in one
    forward (within the SP token budget)."""
    w, h, f = size
    world = fleet.world_size
    t1, t2 = _padded(_tokens(w, h, f, 2), world), _padded(_tokens(w, h, f, 1), world)
    return t1, t2, max(1, min(fleet.passes, sp_tokens(fleet) // max(1, t1)))


def largest(
    fleet: FleetMemory, width: int, height: int, num_frames: int, frame_rate: float = DEFAULT_FRAME_RATE
) -> dict[str, str | None]:
    """The largest sizes that fit this fleet near the asked one, each a size the runner's rules accept: the
    most frames (8k+1) at width x height, and the largest width x height (its multiples, about the same
    aspect) at `num_frames`. None where none fits."""
    rules = fleet.rules
    # a suggestion keeps SUGGESTION_MARGIN more free than the limit: another worker on the same card may offer
    # a little less (a context more, another process), and a size suggested by one must be taken by the next
    margin = replace(fleet, headroom_gib=fleet.headroom_gib + SUGGESTION_MARGIN * (fleet.capacity_gib or 0.0))

    def fits(w: int, h: int, f: int) -> bool:
        return plan(margin, w, h, f, frame_rate=frame_rate).fits

    snapped = rules.fit_size(width, height, num_frames)
    if snapped is None:
        return {"frames": None, "area": None}
    sw, sh, sf = snapped
    frames = next((f for f in rules.frame_counts(sf) if fits(sw, sh, f)), None)
    aspect, m = width / max(1, height), rules.spatial_multiple
    area = None
    for h in range(sh, m - 1, -m):
        size = rules.fit_size(max(m, round(h * aspect / m) * m), h, sf)
        if size is not None and fits(*size):
            area = "x".join(map(str, size))
            break
    found = None if frames is None else f"{sw}x{sh}x{frames}"
    return {"frames": found, "area": None if area == found else area}  # (one suggestion, not the same twice)
