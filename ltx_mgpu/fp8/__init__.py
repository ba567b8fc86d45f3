"""FP8 e4m3 linear layers for the LTX-2 transformer on Hopper (`quantization="fp8-mm"`; docs/runners.md).

- `rowwise`: per-token activation and per-channel weight quantization (eager; `triton_rows` on CUDA);
- `linear`: `Fp8Linear` (`torch._scaled_mm`, or an exact-dequantization emulation off Hopper) and the
  fusions that make the activation quantization cheap;
- `recipe`: which layers convert (ltx-core's fp8-scaled-mm recipe) and the loading policy;
- `lora`: LoRAs fused into the e4m3 weights and re-quantized (eager; `triton_lora` on CUDA).
"""

from .linear import Fp8GeluProj, Fp8Linear, Fp8Rows, SharedInput, fp8_gemm, fp8_tensor_cores
from .recipe import convert_linears, fp8_layer_names, fp8_mm_policy
from .rowwise import quantize_rows, quantize_rows_eager, quantize_weight

__all__ = [
    "Fp8GeluProj",
    "Fp8Linear",
    "Fp8Rows",
    "SharedInput",
    "convert_linears",
    "fp8_gemm",
    "fp8_layer_names",
    "fp8_mm_policy",
    "fp8_tensor_cores",
    "quantize_rows",
    "quantize_rows_eager",
    "quantize_weight",
]
