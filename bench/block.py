"""One LTX-2 transformer block built for a benchmark: its widths, random weights, and inputs prepared by the
model's own preprocessors, so every block benchmark (`bench.sp_block`, `bench.fp8`, `bench.fp8_attn_block`)
times the same block at the same token counts.

The block is ltx-core's `BasicAVTransformerBlock` (video + audio streams and both cross-attentions) with
random weights scaled by 1/sqrt(fan-in) (activations keep a unit-order scale through the block), or, where
ltx-core is not installed, `bench.fp8_standin.StandInBlock` (the same linears and call pattern). Video token
counts map to a latent geometry (`geometry`) at LTX-2's 8x temporal, 32x spatial compression; audio is 126
tokens (121 frames at 24 fps) and the text context 128 random tokens.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from bench.fp8_standin import StandInBlock

__all__ = ["AUDIO_TOKENS", "DIMS", "GEOMETRY", "BlockCase", "activation", "block_config", "block_inputs",
           "block_outputs", "build_block", "geometry", "modalities"]  # fmt: skip

AUDIO_TOKENS = 126  # 121 frames at 24 fps -> 5.04 s x 25 audio latents/s
GEOMETRY = {  # video tokens -> (latent frames, height, width) at 8x time, 32x space
    6144: (16, 16, 24),
    24576: (16, 32, 48),
    32768: (16, 32, 64),
}
DIMS = {
    "19b": {"heads": 32, "head_dim": 128, "audio_heads": 32, "audio_head_dim": 64, "caption": 3840},
    "tiny": {"heads": 4, "head_dim": 16, "audio_heads": 4, "audio_head_dim": 8, "caption": 32},
}


def geometry(tokens: int) -> tuple[int, int, int]:
    """(latent frames, height, width) holding `tokens` video tokens: the table's, else as many frames (<= 16)
    as divide `tokens` and the most square frame."""
    if tokens in GEOMETRY:
        return GEOMETRY[tokens]
    frames = 1
    for f in (16, 8, 4, 2):
        if tokens % f == 0:
            frames = f
            break
    rest = tokens // frames
    h = int(math.sqrt(rest))
    while rest % h:
        h -= 1
    return frames, h, rest // h


def block_config(dims: dict[str, int]) -> dict[str, Any]:
    """ltx-core's transformer config of a one-block model at `dims` (a `DIMS` entry), torch SDPA attention."""
    from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

    cfg = tiny_transformer_config(
        num_layers=1,
        num_heads=dims["heads"],
        head_dim=dims["head_dim"],
        audio_num_heads=dims["audio_heads"],
        audio_head_dim=dims["audio_head_dim"],
        latent_channels=128,
        audio_channels=128,
        caption_channels=dims["caption"],
    )
    cfg["transformer"]["attention_type"] = "pytorch"
    return cfg


def build_block(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The one-block model of `cfg`, built on `device` (no CPU copy) with seeded random weights, in eval mode."""
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    with torch.device("meta"):
        model = LTXModelConfigurator.from_config(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() >= 2 else 1
            p.copy_(torch.randn(p.shape, generator=gen, device=device) / math.sqrt(max(fan_in, 1)) * 0.5)
    return model.to(dtype).eval()


def block_inputs(
    model: torch.nn.Module,
    cfg: dict[str, Any],
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    one_timestep: bool = False,
) -> tuple:
    """TransformerArgs for the block, prepared by the model's own preprocessors (real RoPE, AdaLN, etc.).
    `one_timestep`: one (1, 1, 1) timestep for all tokens, as the runners give a job without conditioning
    (`ltx_mgpu.runners.ltx2.denoise.one_for_every_token`); else one per token, as ltx-core's pipelines do."""
    video, audio = modalities(cfg, tokens, device, dtype, one_timestep=one_timestep)
    with torch.no_grad():
        vargs = model.video_args_preprocessor.prepare(video, audio)
        aargs = model.audio_args_preprocessor.prepare(audio, video)
        vargs_only = model.video_args_preprocessor.prepare(video, None)
        aargs_only = model.audio_args_preprocessor.prepare(audio, None)
    return vargs, aargs, vargs_only, aargs_only


def modalities(
    cfg: dict[str, Any],
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    sigma: float = 0.7,
    one_timestep: bool = False,
) -> tuple[Any, Any]:
    """(video, audio) ltx-core `Modality` inputs: random latents at `tokens` video tokens and 126 audio
    tokens, real positions, a random 128-token text context, every token at `sigma`."""
    from ltx_core.model.transformer.modality import Modality

    from ltx_mgpu.runners.smoke.denoise import SmokeGeometry

    t = cfg["transformer"]
    f, h, w = geometry(tokens)
    fps = 24.0
    geo = SmokeGeometry(w * 32, h * 32, (f - 1) * 8 + 1, fps, t["in_channels"], t["audio_in_channels"])
    vstate = geo.video_tools(1).create_initial_state(device, torch.float32)
    astate = geo.audio_tools(1).create_initial_state(device, torch.float32)
    if vstate.latent.shape[1] != tokens:
        raise ValueError(f"geometry {(f, h, w)} gives {vstate.latent.shape[1]} tokens, wanted {tokens}")
    gen = torch.Generator(device=device).manual_seed(1)
    sigma_t = torch.full((1,), sigma, device=device)
    ctx = torch.randn(1, 128, t["caption_channels"], generator=gen, device=device, dtype=dtype)
    cmask = torch.ones(1, 128, dtype=torch.int64, device=device)

    def modality(state: Any, channels: int) -> Modality:
        n = state.latent.shape[1]
        return Modality(
            latent=torch.randn(1, n, channels, generator=gen, device=device, dtype=dtype),
            sigma=sigma_t,
            timesteps=torch.full((1, 1 if one_timestep else n, 1), sigma, device=device),
            positions=state.positions,
            context=ctx,
            context_mask=cmask,
        )

    return modality(vstate, t["in_channels"]), modality(astate, t["audio_in_channels"])


def activation(b: int, tokens: int, width: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A bf16 activation (b, tokens, width) with every (width/32)-th channel 20x larger: per-token FP8
    scales then meet the outliers trained transformers have."""
    x = torch.randn(b, tokens, width, generator=gen, device=device, dtype=torch.bfloat16)
    x[..., :: max(1, width // 32)] *= 20.0  # a few outlier channels, as trained transformers have
    return x


def block_outputs(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) tensors of a block call (ltx-core returns TransformerArgs, the stand-in tensors)."""
    video, audio = out
    return getattr(video, "x", video), getattr(audio, "x", audio)


class BlockCase:
    """The block under test, bf16 and fp8 (same weights), and how to call it at a token count."""

    def __init__(self, kind: str, dims: dict[str, int], device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.width, self.audio_width = dims["heads"] * dims["head_dim"], dims["audio_heads"] * dims["audio_head_dim"]
        if kind == "ltx":
            self.cfg = block_config(dims)
            self.model = build_block(self.cfg, device, torch.bfloat16)
            self.bf16 = self.model.transformer_blocks[0]
        else:
            torch.manual_seed(0)
            with torch.device(device):  # initialised where it runs: ~0.3 B parameters at 19B dims
                block = StandInBlock(self.width, dims["heads"], self.audio_width, dims["audio_heads"])
            self.bf16 = block.to(dtype=torch.bfloat16).eval()
        from ltx_mgpu.fp8 import convert_linears

        self.fp8 = convert_linears(copy.deepcopy(self.bf16), quantize=True)
        self.fused: tuple[Any, Any] | None = None

    def fuse(self) -> None:
        """Fused-elementwise copies of the bf16 and fp8 blocks (`ltx_mgpu.fused`; ltx-core's block only)."""
        from ltx_mgpu.fused.block import fuse_elementwise

        self.fused = tuple(copy.deepcopy(b) for b in (self.bf16, self.fp8))
        for b in self.fused:
            fuse_elementwise(b)

    def ltx_args(self, tokens: int, one_timestep: bool = False) -> tuple[Any, Any, Any]:
        """(video args, audio args, perturbations): what an ltx-core block is called with at `tokens`
        (`one_timestep`: see `block_inputs`)."""
        from ltx_core.guidance.perturbations import BatchedPerturbationConfig

        vargs, aargs, _, _ = block_inputs(self.model, self.cfg, tokens, self.device, torch.bfloat16, one_timestep)
        return vargs, aargs, BatchedPerturbationConfig.empty(1)

    def calls(self, tokens: int) -> tuple[Any, Any, Any]:
        """(bf16 call, fp8 call, the input's video tokens x) for `tokens` video tokens."""
        if self.kind == "ltx":
            vargs, aargs, pert = self.ltx_args(tokens)
            return (lambda: self.bf16(vargs, aargs, pert)), (lambda: self.fp8(vargs, aargs, pert)), vargs.x
        gen = torch.Generator(device=self.device).manual_seed(tokens + 1)
        x = activation(1, tokens, self.width, gen, self.device)
        ctx = torch.randn(1, 128, self.width, generator=gen, device=self.device, dtype=torch.bfloat16)
        audio = torch.randn(1, 126, self.audio_width, generator=gen, device=self.device, dtype=torch.bfloat16)
        return (lambda: self.bf16(x, ctx, audio)), (lambda: self.fp8(x, ctx, audio)), x
