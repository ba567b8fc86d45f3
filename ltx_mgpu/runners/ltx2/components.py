"""Loading the LTX-2 components from local checkpoint files with ltx-core's builders.

Every component goes through `SingleGPUModelBuilder` (safetensors, config from the file's metadata, the
released key layouts via ltx-core's sd ops) and is checked after loading with `common.loading.build_checked`
(a tensor still on the meta device is a `RuntimeError` naming the file and the first missing tensors). The
audio decoder and vocoder builders are in `common.audio` (the smoke runner uses them too).

Quantization is passed through, never ignored: `quantization_policy(name)` returns ltx-core's policy for
"fp8-cast" or "fp8-scaled-mm" (the latter needs TensorRT-LLM and says so), ours for "fp8-mm" (FP8 GEMMs
through `torch._scaled_mm`, `ltx_mgpu.fp8`) and "fp8-mm+attn" (those plus the video self-attention in FP8,
`ltx_mgpu.fp8.attention`), and unknown names raise.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common.loading import file_builder
from .spec import QUANTIZATIONS

CHECKPOINT = "LTX-2 checkpoint"

__all__ = [
    "DTYPES",
    "QUANTIZATIONS",
    "check_gpu",
    "check_quantized",
    "distributed_video_decoder",
    "parse_dtype",
    "quantization_policy",
    "transformer_builder",
    "upsampler_builder",
    "video_decoder_builder",
    "video_encoder_builder",
]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def quantization_policy(name: str | None) -> Any:
    """ltx-core `QuantizationPolicy` for `name` (None / "none" -> None)."""
    if name in (None, "", "none"):
        return None
    # ltx-core 1.0.0 has an import cycle (quantization.fp8_cast -> loader -> fuse_loras -> fp8_cast):
    # importing `ltx_core.quantization` first in a fresh process fails; importing the loader first works.
    import ltx_core.loader  # noqa: F401
    from ltx_core.quantization import QuantizationPolicy

    if name == "fp8-cast":
        return QuantizationPolicy.fp8_cast()
    if name == "fp8-mm":
        from ...fp8 import fp8_mm_policy

        return fp8_mm_policy()
    if name == "fp8-mm+attn":
        from ...fp8.attention import fp8_mm_attn_policy

        return fp8_mm_attn_policy()
    if name == "fp8-scaled-mm":
        try:
            return QuantizationPolicy.fp8_scaled_mm()
        except ImportError as exc:
            raise ValueError(f"quantization 'fp8-scaled-mm' needs TensorRT-LLM: {exc}") from exc
    raise ValueError(f"unknown quantization {name!r}; expected one of {QUANTIZATIONS} or None")


def transformer_builder(checkpoint: str, *, quantization: Any = None, registry: Any = None) -> Any:
    """The AV transformer from an LTX-2 checkpoint ("model.diffusion_model." keys), with the quantization
    policy's sd ops chained after the key renaming and its module ops appended."""
    from ltx_core.loader import SDOps
    from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator

    sd_ops = LTXV_MODEL_COMFY_RENAMING_MAP
    module_ops: tuple[Any, ...] = ()
    if quantization is not None:
        if quantization.sd_ops is not None:
            chained = (*sd_ops.mapping, *quantization.sd_ops.mapping)
            sd_ops = SDOps(name=f"{sd_ops.name}+{quantization.sd_ops.name}", mapping=chained)
        module_ops = tuple(quantization.module_ops)
    return file_builder(
        LTXModelConfigurator, checkpoint, CHECKPOINT, sd_ops=sd_ops, module_ops=module_ops, registry=registry
    )


def video_decoder_builder(checkpoint: str, *, registry: Any = None) -> Any:
    from ltx_core.model.video_vae import VAE_DECODER_COMFY_KEYS_FILTER, VideoDecoderConfigurator

    return file_builder(
        VideoDecoderConfigurator, checkpoint, CHECKPOINT, sd_ops=VAE_DECODER_COMFY_KEYS_FILTER, registry=registry
    )


def video_encoder_builder(checkpoint: str, *, registry: Any = None) -> Any:
    from ltx_core.model.video_vae import VAE_ENCODER_COMFY_KEYS_FILTER, VideoEncoderConfigurator

    return file_builder(
        VideoEncoderConfigurator, checkpoint, CHECKPOINT, sd_ops=VAE_ENCODER_COMFY_KEYS_FILTER, registry=registry
    )


def upsampler_builder(path: str, *, registry: Any = None) -> Any:
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    return file_builder(LatentUpsamplerConfigurator, path, "spatial upsampler", registry=registry)


def check_gpu(name: str | None, device: torch.device) -> None:
    """Before anything loads: the quantization `name` can run on `device` (`ltx_mgpu.spec.gpu_needs`, the table
    the worker checked before the fleet started; the emulation an older GPU would fall back to dequantizes every
    weight per call)."""
    if device.type != "cuda":
        return
    from ...spec.gpu_needs import capability_problem

    capability = torch.cuda.get_device_capability(device)
    problem = capability_problem(name, capability, torch.cuda.get_device_name(device))
    if problem is not None:
        raise ValueError(problem)


def check_quantized(model: torch.nn.Module, name: str | None) -> None:
    """Prove a quantization policy took effect (the reference's CLIs silently dropped it)."""
    if name == "fp8-cast" and torch.float8_e4m3fn not in {p.dtype for p in model.parameters()}:
        raise RuntimeError("quantization 'fp8-cast' was requested but no transformer weight is float8")
    if name in ("fp8-mm", "fp8-mm+attn"):  # (the GPU's capability: `check_gpu`, before the weights load)
        from ...fp8 import Fp8Linear

        if not any(isinstance(m, Fp8Linear) for m in model.modules()):
            raise RuntimeError(f"quantization {name!r} was requested but no transformer Linear computes in fp8")
    if name == "fp8-mm+attn":
        from ...fp8.attention import fp8_attention_count, fp8_attention_support

        if not fp8_attention_count(model):
            raise RuntimeError("quantization 'fp8-mm+attn' was requested but no attention computes in fp8")
        why = fp8_attention_support(next(model.parameters()).device)
        if why is not None:
            raise ValueError(f"quantization 'fp8-mm+attn': {why}")


def distributed_video_decoder(
    checkpoint: str,
    group: Any,
    tiling: Any,
    chunked: bool,
    device: torch.device,
    dtype: torch.dtype,
    *,
    chunk_frames: int = 0,
) -> Any:
    """The video VAE decoder of `checkpoint` on every rank of `group`, decoding spatial tiles across ranks
    (`chunked`: each tile in ltx-core's default chunks, to bound memory; else `chunk_frames` > 0: temporal
    chunks of that many frames, 24 of overlap (8 below 32), so a streamed hand-off starts the encode early)."""
    from ltx_core.model.video_vae import TilingConfig

    from ...parallel.pipeline.vae_decode import DistributedDecoderBuilder

    return DistributedDecoderBuilder(
        video_decoder_builder(checkpoint),
        group=group,
        tiling=tiling,
        chunk_tiling=TilingConfig.default() if chunked else _temporal_chunks(chunk_frames),
    ).build(device, dtype)


def _temporal_chunks(frames: int) -> Any:
    if frames <= 0:
        return None
    from ltx_core.model.video_vae import TemporalTilingConfig, TilingConfig

    if frames < 16 or frames % 8:  # (ltx-core's own checks, with the setting's name)
        raise ValueError(f"vae_chunk_frames must be 0 or a multiple of 8 from 16, got {frames}")
    return TilingConfig(temporal_config=TemporalTilingConfig(frames, 24 if frames >= 32 else 8))
