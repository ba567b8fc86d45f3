"""Fused elementwise work of the LTX-2 transformer block (modulated norms, gated residuals, q/k norm + split
RoPE) as Triton kernels, for the bf16 and the FP8 (`ltx_mgpu.fp8`) blocks alike: `ops` (the operations and
their eager definitions), `triton_block` (the kernels), `block` (the block and attention forwards that use
them, installed by `fuse_elementwise(model)`)."""
