"""Which LTX-2 transformer layers compute in FP8, and the ltx-core loading policy that gets them there.

The recipe is ltx-core's own `fp8-scaled-mm` recipe (`ltx_core.quantization.fp8_scaled_mm`, the one the
reference offers through TensorRT-LLM), read from its constants rather than restated: every `nn.Linear` is
converted except those whose name contains one of `EXCLUDED_LAYER_SUBSTRINGS`, i.e. the patchify and output
projections, every AdaLN (timestep) embedding, the caption projections (video and audio), and all of
transformer blocks 0 and 43-47 (the first and last five of the 48-block 19B model). Norms, RoPE, the
scale-shift tables and attention itself stay bf16 (they are not Linears). For a model of another depth the
same names apply (a 2-block tiny model keeps block 0 and converts block 1).

Loading (`fp8_mm_policy()`, an ltx-core `QuantizationPolicy`):
- module op: on the meta model, converted Linears become `Fp8Linear`, their attention's input projections
  share one `SharedInput`, and each converted feed-forward gets `Fp8GeluProj` (GELU fused into the
  quantization);
- sd op on `transformer_blocks.*`: a bf16/fp32 weight of a converted layer is quantized as it is read (per
  output channel, on the load device; `weight_scale` is added); an e4m3 weight (a published fp8 checkpoint:
  weights (out, in) in e4m3 with a 0-d `weight_scale`, the dequantization multiplier) is kept with its
  file scale, which `Fp8Linear` widens to one per channel; `input_scale` (a static activation scale for
  TensorRT-LLM) is dropped: activations are scaled per token at run time, which is never coarser.
  An e4m3 weight for a layer the recipe keeps in bf16 is refused (it would load without its scale).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .linear import Fp8GeluProj, Fp8Linear, SharedInput
from .rowwise import E4M3, quantize_weight

__all__ = ["FP8_MM_MODULE_OPS_NAME", "convert_linears", "excluded", "fp8_layer_names", "fp8_mm_policy"]

FP8_MM_MODULE_OPS_NAME = "fp8_mm_linears"


def _excluded_substrings() -> tuple[str, ...]:
    import ltx_core.loader  # noqa: F401  (ltx-core 1.0.0's import cycle: the loader must come first)
    from ltx_core.quantization.fp8_scaled_mm import EXCLUDED_LAYER_SUBSTRINGS

    return tuple(EXCLUDED_LAYER_SUBSTRINGS)


def excluded(name: str) -> bool:
    """The recipe keeps layer `name` (a module path, e.g. 'transformer_blocks.0.attn1.to_q') in bf16."""
    return any(s in name for s in _excluded_substrings())


def fp8_layer_names(model: nn.Module) -> list[str]:
    """The Linear layers of `model` the recipe converts."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | Fp8Linear) and not excluded(n)]


def convert_linears(model: nn.Module, *, quantize: bool = False) -> nn.Module:
    """Replace the recipe's Linears by `Fp8Linear` in place (`quantize`: from the Linears' own weights, for
    a model already loaded; otherwise empty ones, for a meta model about to be loaded)."""
    names = set(fp8_layer_names(model))
    for name in sorted(names):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        if isinstance(old, Fp8Linear):
            continue
        new = Fp8Linear.from_linear(old)
        setattr(parent, leaf, new.load_from(old) if quantize else new)
    _wire(model)
    return model


def _wire(model: nn.Module) -> None:
    """Shared input quantization per attention, fused GELU per feed-forward (see the module docstring)."""
    for module in model.modules():
        if all(isinstance(getattr(module, p, None), Fp8Linear) for p in ("to_q", "to_k", "to_v")):
            share = SharedInput()
            for p in ("to_q", "to_k", "to_v", "to_gate_logits"):
                lin = getattr(module, p, None)
                if isinstance(lin, Fp8Linear):
                    lin.share = share
            out = getattr(module, "to_out", None)
            if isinstance(out, nn.Sequential) and isinstance(out[0], Fp8Linear):
                out[0].share, out[0].closes_share = share, True
        net = getattr(module, "net", None)
        if (
            isinstance(net, nn.Sequential)
            and len(net) == 3
            and isinstance(getattr(net[0], "proj", None), Fp8Linear)
            and isinstance(net[2], Fp8Linear)
            and not isinstance(net[0], Fp8GeluProj)
            and type(net[0]).__name__ == "GELUApprox"
        ):
            net[0] = Fp8GeluProj(net[0].proj)


def _kv_op(key: str, value: torch.Tensor) -> list[Any]:
    from ltx_core.loader.sd_ops import KeyValueOperationResult as R

    if key.endswith(".input_scale"):
        return []
    layer = key.rsplit(".", 1)[0]
    if not key.endswith(".weight") or value.dim() != 2:
        return [R(key, value)]
    if excluded(layer):
        if value.dtype == E4M3:
            raise ValueError(f"fp8-mm: '{key}' is float8 in the checkpoint but the recipe keeps it in bf16")
        return [R(key, value)]
    if value.dtype == E4M3:
        return [R(key, value)]
    q, scale = quantize_weight(value)
    return [R(key, q), R(f"{layer}.weight_scale", scale)]


def fp8_mm_policy() -> Any:
    """The ltx-core `QuantizationPolicy` of `quantization="fp8-mm"`."""
    import ltx_core.loader  # noqa: F401
    from ltx_core.loader.module_ops import ModuleOps
    from ltx_core.loader.sd_ops import SDOps
    from ltx_core.model.transformer import LTXModel
    from ltx_core.quantization import QuantizationPolicy

    sd_ops = SDOps("fp8_mm_quantize").with_kv_operation(_kv_op, key_prefix="transformer_blocks.")
    module_ops = ModuleOps(
        name=FP8_MM_MODULE_OPS_NAME, matcher=lambda m: isinstance(m, LTXModel), mutator=convert_linears
    )
    return QuantizationPolicy(sd_ops=sd_ops, module_ops=(module_ops,))
