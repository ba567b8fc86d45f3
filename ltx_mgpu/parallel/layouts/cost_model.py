"""Which layout (G guidance groups x S SP ranks) a denoising stage runs with: a small cost model and the
`parallel_layout` override.

Why a model and not a rule: one GPU runs batched passes near its compute floor but small single passes
badly (host- and latency-bound), so at LTX-2's stage-1 size (1,536 video tokens) SP buys nothing and the
second GPU must take whole passes; at 6,144 tokens and above SP divides real work. The crossover moves
with the pass count, the token count, the world size and whether the forward is graphed, which a
per-layer estimate captures in a few lines:

    rows      = ceil(P / G)                        passes one group runs, batched
    tokens    = ceil(T / S)                        video tokens per rank
    rate      = flops_per_s * M / (M + half_rate_tokens),  M = rows * tokens   (small matmuls run slower)
    gpu       = max(gpu_floor, rows * flop(T, S) / rate) + exchanges(rows, T, S)
    layer     = max(host, gpu)                     eager: the host issues work while the GPU runs it
    step      = layers * layer + gather(G)         one all-gather of the outputs per step when G > 1

`flop` counts the matmuls of an LTX-2 block (video tokens per rank; the audio stream and the text
context's key/value projections in full, since SP repeats them on every rank) plus attention. Every
constant lives in `CostModel`; `DEFAULT_COST_MODEL` is fitted to measurements on two
H200s, 19B block dimensions, bf16) and `bench/sp_scaling.py` prints a re-fit (`"kind": "calibration"`).

Valid layouts: G * S = W, S divides the video and audio head counts, and G <= P (a group without passes
would idle; the override may still ask for it and then that group waits at the gather).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .layout import ParallelLayout, layouts_for

__all__ = [
    "DEFAULT_COST_MODEL",
    "CostModel",
    "LayerDims",
    "LayoutChoice",
    "LayoutPolicy",
    "StepShape",
    "choose_layout",
    "valid_layouts",
]


@dataclass(frozen=True)
class LayerDims:
    """The widths of one LTX-2 AV transformer block that the cost depends on (19B defaults)."""

    video_heads: int = 32
    video_head_dim: int = 128
    audio_heads: int = 32
    audio_head_dim: int = 64
    context_dim: int = 4096  #: video cross-attention width (text context after projection)
    audio_context_dim: int = 2048
    ffn_mult: int = 4

    @classmethod
    def from_config(cls, transformer: Mapping[str, Any]) -> LayerDims:
        """From an ltx-core transformer config dict (`model_config()["transformer"]`)."""
        return cls(
            video_heads=int(transformer.get("num_attention_heads", 32)),
            video_head_dim=int(transformer.get("attention_head_dim", 128)),
            audio_heads=int(transformer.get("audio_num_attention_heads", 32)),
            audio_head_dim=int(transformer.get("audio_attention_head_dim", 64)),
            context_dim=int(transformer.get("cross_attention_dim", 4096)),
            audio_context_dim=int(transformer.get("audio_cross_attention_dim", 2048)),
        )

    @property
    def video_width(self) -> int:
        return self.video_heads * self.video_head_dim

    @property
    def audio_width(self) -> int:
        return self.audio_heads * self.audio_head_dim

    def matmul_params(self) -> tuple[int, int, int]:
        """Weights touched per (video token, audio token, context token) in one block."""
        d, a, f = self.video_width, self.audio_width, self.ffn_mult
        video = 4 * d * d + 2 * d * d + 2 * f * d * d + 4 * d * a  # self attn, text q/out, FFN, a2v q/out + v2a k/v
        audio = 4 * a * a + 2 * a * a + 2 * f * a * a + 4 * a * a  # same for the audio stream
        context = 2 * self.context_dim * d + 2 * self.audio_context_dim * a  # text k/v of both streams
        return video, audio, context

    def layer_flop(self, tokens: int, sequence: int, audio_tokens: int, context_tokens: int) -> float:
        """FLOP of one block for one pass on one rank of an S-rank SP group (T padded to a multiple of S)."""
        local = math.ceil(tokens / sequence)
        padded = local * sequence
        pv, pa, pc = self.matmul_params()
        d, a = self.video_width, self.audio_width
        matmul = 2.0 * (pv * local + pa * audio_tokens + pc * context_tokens)
        attention = 4.0 * (
            local * padded * d  # video self-attention: local queries x all keys (H/S heads each, S ranks)
            + local * context_tokens * d  # video -> text
            + audio_tokens * padded * a / sequence  # audio queries over the video keys, H/S heads
            + local * audio_tokens * a  # video queries over audio
            + audio_tokens * (audio_tokens + context_tokens) * a  # audio self + audio -> text
        )
        return matmul + attention

    def exchange_bytes(self, tokens: int, sequence: int, audio_tokens: int, itemsize: int = 2) -> float:
        """Bytes one rank sends per block under SP (q, k, v, out of the video self-attention; k, v and the
        output of the audio-over-video attention)."""
        if sequence == 1:
            return 0.0
        local = math.ceil(tokens / sequence)
        leave = (sequence - 1) / sequence
        video = 4 * local * self.video_width * leave
        audio_kv = 2 * local * self.audio_width * leave
        audio_out = audio_tokens * self.audio_width / sequence * (sequence - 1)
        return (video + audio_kv + audio_out) * itemsize


EXCHANGES_PER_LAYER = 7  #: q, k, v, out (video self-attention) + k, v, out (audio over video)


@dataclass(frozen=True)
class StepShape:
    """One denoising step as the cost model prices it (one place for what every estimate takes)."""

    tokens: int  #: video tokens of one pass (T)
    passes: int  #: passes of the step (P: 1, or 2-3 with guidance), batched within a group
    dims: LayerDims
    audio_tokens: int = 126  #: every pass carries these whole (SP repeats them on every rank)
    context_tokens: int = 1024  #: text tokens every pass attends to
    graphed: bool = False  #: the forward replays a captured graph (host cost of a replay only)

    def rows(self, layout: ParallelLayout) -> int:
        """Passes one guidance group runs (ceil(P / G)); 0 when the step has none."""
        return math.ceil(self.passes / layout.guidance)


@dataclass(frozen=True)
class CostModel:
    """The constants of the layout cost model (milliseconds per layer unless stated)."""

    flops_per_s: float = 440e12  #: rate of a whole block at large batches (6,144 tokens x 3 passes: 26 ms/layer)
    half_rate_tokens: float = 512.0  #: tokens per rank (rows x T/S) at which a block runs at half that rate
    gpu_floor_ms: float = 0.6  #: a forward of a layer never runs faster than this (latency-bound kernels)
    #: eager launch cost of one layer in a fleet rank, host-bound: 1,536 tokens one pass took 38.2 ms (W=1)
    #: and 35.9 ms (W=2, SP) for 8 layers, equal within the run-to-run spread; SP issues 7 more ops per
    #: layer (the exchanges, ~0.03 ms of host time each), which is the difference kept here
    host_ms_eager: float = 4.5
    host_ms_eager_sp: float = 4.7
    host_ms_graphed: float = 0.02  #: replaying a captured layer
    exchange_ms: float = 0.03  #: fixed cost of one head exchange (ipc zero-copy, two H200s)
    link_bytes_per_s: float = 360e9  #: NVLink, one direction, both directions busy
    gather_ms: float = 0.05  #: fixed cost of the per-step all-gather of the pass outputs
    itemsize: int = 2  #: bf16 activations

    def compute_ms(self, layout: ParallelLayout, shape: StepShape) -> float:
        """GPU time of one layer's arithmetic on one rank (no floor, no exchanges, no host)."""
        rows = shape.rows(layout)
        if rows == 0:
            return 0.0
        flop = rows * shape.dims.layer_flop(shape.tokens, layout.sequence, shape.audio_tokens, shape.context_tokens)
        m = rows * math.ceil(shape.tokens / layout.sequence)
        return flop / (self.flops_per_s * m / (m + self.half_rate_tokens)) * 1e3

    def layer_ms(self, layout: ParallelLayout, shape: StepShape) -> float:
        """Estimated time of one layer of one denoising step under `layout`."""
        s = layout.sequence
        rows = shape.rows(layout)
        if rows == 0:
            return 0.0
        gpu = max(self.gpu_floor_ms, self.compute_ms(layout, shape))
        if s > 1:
            sent = rows * shape.dims.exchange_bytes(shape.tokens, s, shape.audio_tokens, self.itemsize)
            gpu += EXCHANGES_PER_LAYER * self.exchange_ms + sent / self.link_bytes_per_s * 1e3
        if shape.graphed:
            host = self.host_ms_graphed
        else:
            host = self.host_ms_eager_sp if s > 1 else self.host_ms_eager
        return max(host, gpu)

    def step_ms(self, layout: ParallelLayout, shape: StepShape, *, layers: int, out_channels: int = 128) -> float:
        """Estimated time of one denoising step (all layers, plus the guidance all-gather)."""
        step = layers * self.layer_ms(layout, shape)
        if layout.guidance > 1:
            per_row = (shape.tokens + shape.audio_tokens) * out_channels * self.itemsize
            gathered = shape.rows(layout) * per_row * (layout.guidance - 1)
            step += self.gather_ms + gathered / self.link_bytes_per_s * 1e3
        return step


DEFAULT_COST_MODEL = CostModel()


def valid_layouts(
    world_size: int, passes: int, dims: LayerDims, *, allow_idle_groups: bool = False
) -> list[ParallelLayout]:
    """Layouts a stage with `passes` passes may use: S divides both head counts, and G <= passes unless
    `allow_idle_groups` (overrides)."""
    out = []
    for layout in layouts_for(world_size):
        if dims.video_heads % layout.sequence or dims.audio_heads % layout.sequence:
            continue
        if layout.guidance > max(1, passes) and not allow_idle_groups:
            continue
        out.append(layout)
    return out


@dataclass(frozen=True)
class LayoutChoice:
    """The layout of one stage and why it was picked (what the stage event reports)."""

    layout: ParallelLayout
    source: str  #: "auto" (cost model) or "override" (setup kwarg `parallel_layout`)
    estimates_ms: dict[str, float]  #: estimated step time per valid layout (auto only)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.layout.describe(), "source": self.source}
        if self.estimates_ms:
            out["estimated_step_ms"] = {k: round(v, 2) for k, v in self.estimates_ms.items()}
        return out


def choose_layout(
    world_size: int, shape: StepShape, *, layers: int, model: CostModel = DEFAULT_COST_MODEL
) -> LayoutChoice:
    """The valid layout with the smallest estimated step time (ties: fewer collectives, i.e. larger G).

    When no layout keeps every group busy (a world whose size does not divide the head counts, e.g. 3
    ranks for 32 heads, and fewer passes than ranks), layouts with idle groups are considered too (Wx1
    always fits)."""
    candidates = valid_layouts(world_size, shape.passes, shape.dims) or valid_layouts(
        world_size, shape.passes, shape.dims, allow_idle_groups=True
    )
    estimates = {str(layout): model.step_ms(layout, shape, layers=layers) for layout in candidates}
    best = min(candidates, key=lambda layout: (round(estimates[str(layout)], 6), -layout.guidance))
    return LayoutChoice(best, "auto", estimates)


class LayoutPolicy:
    """Per-stage layout decisions of a runner: the `parallel_layout` override, else the cost model.

    `parallel_layout`: None or "auto" (cost model everywhere), "GxS" (every guided stage), or a mapping
    {stage name: "GxS" | "auto"}. Overrides are validated at construction (setup) so a bad value fails
    the fleet start, not a job: G * S must equal the world size and S must divide the head counts.
    """

    def __init__(
        self,
        parallel_layout: str | Mapping[str, str] | None,
        *,
        world_size: int,
        dims: LayerDims,
        layers: int,
        model: CostModel = DEFAULT_COST_MODEL,
    ) -> None:
        self.world_size = world_size
        self.dims = dims
        self.layers = layers
        self.model = model
        self._default: ParallelLayout | None = None
        self._per_stage: dict[str, ParallelLayout | None] = {}
        if isinstance(parallel_layout, Mapping):
            for stage, value in parallel_layout.items():
                self._per_stage[str(stage)] = self._parse(value)
        else:
            self._default = self._parse(parallel_layout)

    def _parse(self, value: str | None) -> ParallelLayout | None:
        if value is None or str(value).strip().lower() == "auto":
            return None
        layout = ParallelLayout.parse(value)
        fitting = [str(x) for x in valid_layouts(self.world_size, 1, self.dims, allow_idle_groups=True)]
        if str(layout) not in fitting:
            raise ValueError(
                f"parallel_layout {layout} does not fit a fleet of {self.world_size} ranks with "
                f"{self.dims.video_heads}/{self.dims.audio_heads} heads (G x S must equal {self.world_size} and S "
                f"divide the head counts; valid: {', '.join(fitting)})"
            )
        return layout

    def override_for(self, stage: str) -> ParallelLayout | None:
        return self._per_stage.get(stage, self._default) if self._per_stage else self._default

    def choose(
        self,
        stage: str,
        *,
        tokens: int,
        passes: int,
        audio_tokens: int = 126,
        context_tokens: int = 1024,
        graphed: bool = False,
    ) -> LayoutChoice:
        override = self.override_for(stage)
        if override is not None:
            return LayoutChoice(override, "override", {})
        shape = StepShape(tokens, passes, self.dims, audio_tokens, context_tokens, graphed)
        return choose_layout(self.world_size, shape, layers=self.layers, model=self.model)

    def with_model(self, model: CostModel) -> LayoutPolicy:
        """The same overrides with other constants (e.g. a calibration from the benchmark)."""
        other = LayoutPolicy(None, world_size=self.world_size, dims=self.dims, layers=self.layers, model=model)
        other._default, other._per_stage = self._default, dict(self._per_stage)
        return other
