"""The fused elementwise kernels (`ltx_mgpu.fused`) on a GPU: against the eager ltx-core expressions at LTX-2's
widths, and a 19B-width LTX-2 block (bf16 and fp8) fused against ltx-core's forward, also replayed from a CUDA
graph. Tolerances: `ops.NORM_TOLERANCE` (one bf16 ulp of the norm, derived in `ltx_mgpu.fused.ops`) for single
ops; for the block, where a flipped norm rounding passes through attention and the linears, a relative error
of 2**-7 (one bf16 ulp) of the block's update, far below the 3% the FP8 block is allowed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ltx_mgpu.fused import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parent.parent


def _within(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> None:
    t = ops.NORM_TOLERANCE  # the bound derived in the `ltx_mgpu.fused.ops` docstring
    bound = 2 * (1 + t) * t * base.float().abs() + 2 * t * want.float().abs() + 2.0**-126
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert (got == want).float().mean().item() > 0.99


@pytest.mark.parametrize(("tokens", "d"), [(1536, 4096), (333, 2048)])
def test_residual_norm_kernel_matches_eager(tokens, d):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(2, tokens, d, generator=gen, device="cuda") * 3).bfloat16()
    y = torch.randn(2, tokens, d, generator=gen, device="cuda").bfloat16()
    ada = (torch.randn(2, 1, 3, d, generator=gen, device="cuda") * 0.2).bfloat16()
    shift, scale, gate = ada.unbind(dim=2)
    mask = torch.tensor([1.0, 0.0], device="cuda").bfloat16().view(2, 1, 1)
    got, want = ops.residual_norm(x, y, gate, mask, norm=False), ops.residual_norm_eager(x, y, gate, mask, norm=False)
    assert torch.equal(got[0], want[0])
    (xk, nk), (xe, ne) = (
        ops.residual_norm(x, y, gate, scale=scale, shift=shift),
        ops.residual_norm_eager(x, y, gate, scale=scale, shift=shift),
    )
    assert torch.equal(xk, xe)
    _within(nk, ne, torch.nn.functional.rms_norm(xe, (d,), eps=1e-6) * (1 + scale))


def test_norm_rope_kernel_matches_eager():
    from ltx_core.model.transformer.rope import LTXRopeType, precompute_freqs_cis

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, d = 1536, 4096
    q = (torch.randn(1, t, d, generator=gen, device="cuda") * 4).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).bfloat16()
    pos = torch.stack([torch.arange(t, device="cuda").float().view(1, t, 1).expand(1, t, 2)] * 3, dim=1)
    cos, sin = precompute_freqs_cis(pos, d, torch.bfloat16, num_attention_heads=32, rope_type=LTXRopeType.SPLIT)
    got, want = ops.norm_rope(q, w, cos, sin, 32), ops.norm_rope_eager(q, w, cos, sin, 32)
    normed = torch.nn.functional.rms_norm(q, (d,), weight=w, eps=1e-6)
    _within(got, want, normed.abs().amax(dim=-1, keepdim=True).expand_as(normed))  # a rotation mixes the halves


@pytest.mark.parametrize("one_timestep", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_block_matches_ltx_core_and_replays_in_a_graph(fp8, one_timestep):
    pytest.importorskip("ltx_core")
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    from bench.block import DIMS, block_config, block_inputs, build_block
    from ltx_mgpu.fp8 import convert_linears, fp8_tensor_cores
    from ltx_mgpu.fused.block import fuse_elementwise

    if fp8 and not fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")
    cfg = block_config(DIMS["19b"])
    cfg["transformer"]["rope_type"] = "split"
    model = build_block(cfg, torch.device("cuda"), torch.bfloat16)
    block = model.transformer_blocks[0]
    if fp8:
        block = convert_linears(block, quantize=True)
    v, a, _, _ = block_inputs(model, cfg, 6144, torch.device("cuda"), torch.bfloat16, one_timestep=one_timestep)
    pert = BatchedPerturbationConfig.empty(1)
    fused = copy.deepcopy(block)
    assert fuse_elementwise(fused) == 7
    with torch.no_grad():
        ref, out = block(v, a, pert), fused(v, a, pert)
        for r, o, x in zip(ref, out, (v.x, a.x), strict=True):
            upd_r, upd_o = r.x.float() - x.float(), o.x.float() - x.float()
            assert ((upd_o - upd_r).norm() / upd_r.norm()).item() < 2.0**-7
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fused(v, a, pert)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fused(v, a, pert)
        graph.replay()
        assert all(torch.equal(s.x, o.x) for s, o in zip(static, out, strict=True))
