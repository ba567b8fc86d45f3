"""The model profiles of the memory plan (`ltx_mgpu.spec.memory_plan`): what each component of a checkpoint weighs and
what its activations cost per unit of work. Which figures are calibrated on the GPU and which derived:
docs/memory.md ("The model").

Stdlib only (the producer imports the plan).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = [
    "FP8_GRAPH_POOL_BYTES",
    "FP8_TOKEN_BYTES",
    "GRAPH_POOL_BYTES",
    "LTX2_19B",
    "MAX_CAPTURE_TOKEN_ROWS",
    "PROFILES",
    "RUNTIME_GIB",
    "TINY",
    "ModelProfile",
]

#: CUDA-graph private pools: the intermediates of every captured forward (per layout and shape) stay in the
#: graph's pool until the graph is dropped, so stage 1's pool is still held in stage 2 and the decode. Per
#: token-row of each captured forward (stage 1's rows x tokens, stage 2's tokens, per rank), calibrated on the
#: one H200 figure the allocator reported: 4.91 GiB in private pools at 1536x1024x241 two-stage CFG
#: (2 x 11,904 stage-1 + 47,616 stage-2 token-rows).
GRAPH_POOL_BYTES = 4.91 * (1 << 30) / (2 * 11904 + 47616)
#: A forward with more token-rows than this on a rank runs eager, never captured: its kernels are long enough that
#: launching them costs about 1% (2x H200, `bench.sp_scaling`: graphs saved 18% of a layer at 3,072 token-rows a
#: rank and 1.2% at 9,216), while its private pool would hold a whole forward's intermediates for the rest of the
#: fleet's life. The runners give the same bound to their `CudaGraphForward` (`max_capture_rows`).
MAX_CAPTURE_TOKEN_ROWS = 16384
#: `quantization="fp8-*"`, measured on one H100 80GB (fp8-mm+attn, distilled, `bench.plan_check`, 2026-12-07, tree
#: `2e982ab`, after the fix of the output projections' leak that the earlier bounds had been fitted to: docs/memory.md
#: "The fp8 figures were fitted to a leak"). A stage-2 forward run eager allocated 8.39 GiB over the stage before at
#: 47,616 tokens and 11.13 GiB at 63,240 (184.8 / 184.5 KiB a token: linear); stage 1's private pool, the reserved
#: memory over the allocated once its capture was done (the upsample stage), 2.52 GiB at 11,904 token-rows and 3.25
#: at 15,810 (222 / 215 KiB a row). Each figure is the larger of its two, plus 4% for what repeated runs of the same
#: size differ by on these cards (the bf16 reserved peaks of one size across runs: 68.5 / 69.9 GiB, 2%).
FP8_GRAPH_POOL_BYTES = 1.04 * 2.52 * (1 << 30) / 11904
FP8_TOKEN_BYTES = 1.04 * 8.39 * (1 << 30) / 47616
#: Workspaces, caches and the pools' fixed part, every rank: refitted with `decode_bytes` (116) once the pools
#: and the SP buffers (none on one GPU) were counted apart, to the distilled 71 / 90 GiB allocator peaks at
#: 768x512x121 / 1536x1024x121 (tests/test_memplan.py; two-stage 114 and 139.2 follow within 0.4 GiB).
#: Those were one-GPU fleets, so the fit also took in the LTX-2 embeddings processor that sits beside Gemma
#: (feature extractor 1.35 GiB + two connectors 0.66 each = 2.67 GiB; the H100 setup's text-encoder lap
#: measured 25.37 GiB against Gemma's 22.7): on a rank without Gemma the figure is ~2.7 GiB high (the plan
#: errs safe there), and it stays whatever Gemma's tier, as the processor does (never parked or streamed).
RUNTIME_GIB = 3.59


@dataclass(frozen=True)
class ModelProfile:
    """What each component weighs and what activations cost (GiB; bytes for the per-unit coefficients)."""

    name: str
    transformer_gib: float
    text_encoder_gib: float
    video_decoder_gib: float
    video_encoder_gib: float
    upsampler_gib: float
    audio_gib: float
    lora_factors_gib: float  #: two-stage: the stage-2 (distilled) LoRA's factors, all ranks together
    lora_weights_gib: float  #: what the LoRA tracker backs up (`lora_figures`), bf16
    lora_weights_fp8_gib: float  #: the same with `quantization="fp8-mm"` (e4m3 + float32 scales, the rest bf16)
    lora_unit_gib: float  #: its largest weight: a rank's greedy share is at most 1/W of the whole plus one
    lora_width_sum: int  #: sum of out + in over those weights: a rank-r LoRA on all of them is r x this
    two_stage_extra_gib: float  #: two-stage: the TDP sibling's buffers and guidance contexts, every rank
    runtime_gib: float  #: CUDA graphs' pools, workspaces, caches: every rank
    token_bytes: float  #: per (token x row) of a transformer forward on a rank
    sp_buffer_bytes: float  #: SP exchange buffers per token of `sp_max_tokens`
    upsample_bytes: float  #: per full-resolution latent cell
    encode_gib: float  #: Gemma's activations for one prompt batch (on its rank)
    decode_bytes: float  #: per pixel-frame decoded at once
    frame_bytes: float  #: per pixel-frame of the driver's blended float32 video and uint8 frames
    cache_fraction: float  #: the allocator's cache above its allocated peak
    graph_pool_bytes: float = 0.0  #: CUDA-graph private pools per token-row of each captured forward (kept)
    text_encoder_layers_gib: float = 0.0  #: its decoder layers: what the `stream` tier pins and copies per forward
    text_encoder_streamed_gib: float = 0.0  #: what stays on the GPU with the `stream` tier (two layers included)
    fp8_token_bytes: float = 0.0  #: `token_bytes` with the fp8 recipe (0: the same as bf16)
    fp8_graph_pool_bytes: float = 0.0  #: `graph_pool_bytes` with the fp8 recipe (0: the same as bf16)
    audio_token_bytes: float = 64 * 1024.0  #: per audio latent x row of a forward (2048 wide: every rank holds all)
    audio_decode_bytes_per_s: float = 16 * 1024.0**2  #: the driver's audio decode + vocoder, per second of clip

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: LTX-2 19B in bf16 (synthetic full-size weights have the same bytes). Calibrated figures are marked so in
#: docs/memory.md (the runtime share, the two-stage extra, `decode_bytes`, `cache_fraction`); the rest is
#: derived from the published parameter counts and layer widths.
LTX2_19B = ModelProfile(
    name="ltx2-19b",
    transformer_gib=35.5,  # ~19.06 B parameters x 2 bytes
    text_encoder_gib=22.7,  # Gemma 3 12B, ~12.2 B x 2
    # its 48 decoder layers 224.2 M parameters each (q 3840x4096, k and v 3840x2048, o 4096x3840, the gated MLP
    # 3 x 3840x15360): 20.05 GiB in bf16. Streamed, the token table (262,208 x 3,840: 1.88 GiB, the head tied to
    # it) and the vision tower (~0.4 B: 0.75 GiB) stay in host memory (`text._host_parts`), and the card holds
    # two layers, three while a parked one's block waits for its copy stream (0.42 GiB each), and the final
    # norm (derived from the shapes, not measured; 3.5 GiB before the table and the tower left the card)
    text_encoder_layers_gib=20.05,
    text_encoder_streamed_gib=1.3,
    video_decoder_gib=0.8,
    video_encoder_gib=0.6,
    upsampler_gib=1.0,
    audio_gib=0.4,  # float32
    lora_factors_gib=6.9,  # rank 384 on every block linear: ~3.7 B x 2
    # `lora_figures` of the full config's transformer (tests/test_memplan_loras.py rebuilds them on meta)
    lora_weights_gib=35.142,
    lora_weights_fp8_gib=20.063,  # blocks 0 and 43-47 and the projections stay bf16 (fp8.recipe)
    lora_unit_gib=0.1875,  # a 4096 x 16384 feed-forward weight
    lora_width_sum=9815552,
    two_stage_extra_gib=0.95,  # (0.6 when the backup was counted as the whole 35.5 GiB transformer)
    runtime_gib=RUNTIME_GIB,
    token_bytes=128 * 1024.0,  # 4096 wide bf16: hidden, q/k/v, out, 4x FFN (x2), residual
    sp_buffer_bytes=32 * 1024.0,  # 4 exchange buffers x 4096 x bf16
    upsample_bytes=4096.0,  # 512 mid channels x bf16 x 4 live tensors
    encode_gib=1.0,
    decode_bytes=116.0,  # fitted with RUNTIME_GIB
    frame_bytes=15.0,  # 3 x float32 + 3 x uint8
    cache_fraction=0.046,
    graph_pool_bytes=GRAPH_POOL_BYTES,
    fp8_token_bytes=FP8_TOKEN_BYTES,
    fp8_graph_pool_bytes=FP8_GRAPH_POOL_BYTES,
)
#: The tiny test checkpoints (CPU fleets): the same shape of plan, with negligible bytes.
TINY = replace(
    LTX2_19B,
    name="tiny",
    transformer_gib=0.01,
    text_encoder_gib=0.01,
    video_decoder_gib=0.001,
    video_encoder_gib=0.001,
    upsampler_gib=0.001,
    audio_gib=0.001,
    lora_factors_gib=0.001,
    two_stage_extra_gib=0.0,
    runtime_gib=0.05,
    sp_buffer_bytes=64.0,
    graph_pool_bytes=0.0,
    fp8_token_bytes=0.0,
    fp8_graph_pool_bytes=0.0,
    audio_token_bytes=256.0,
    lora_weights_gib=0.0049324,
    lora_weights_fp8_gib=0.0041599,
    lora_unit_gib=0.000412,
    lora_width_sum=28768,
)
PROFILES: dict[str, ModelProfile] = {p.name: p for p in (LTX2_19B, TINY)}
