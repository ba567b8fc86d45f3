"""FP8 linears on a GPU with FP8 tensor cores (skipped elsewhere; needs torch with Triton, no ltx-core):
the Triton quantization is bit-identical to the eager definition the CPU tests check, `torch._scaled_mm`
agrees with the CPU emulation up to fp32 summation order, and an `Fp8Linear` chain (shared q/k/v input,
fused GELU) replays under CUDA-graph capture with the eager result.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.fp8 import Fp8Linear, fp8_gemm, fp8_tensor_cores, quantize_rows, quantize_rows_eager, quantize_weight
from ltx_mgpu.fp8.linear import Fp8GeluProj, SharedInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_tensor_cores(torch.device("cuda")), reason="needs FP8 tensor cores"
    ),
]


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda") * torch.logspace(-30, 30, m, base=2.0, device="cuda").view(
        -1, 1
    )
    x[:, ::32] *= 20.0
    x[0] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("k", [200, 2048, 4096, 16384])
def test_triton_quantization_is_bit_identical_to_eager(k):
    x = _x(257, k)
    (qt, st), (qe, se) = quantize_rows(x), quantize_rows_eager(x)
    assert torch.equal(st, se) and torch.equal(qt.view(torch.uint8), qe.view(torch.uint8))
    gt, ge = quantize_rows(x, gelu=True)[0], quantize_rows_eager(x, gelu=True)[0]
    # GELU: the same expression, but the kernel's exp (ex2.approx) and torch's differ by a few ulps, which
    # flips an e4m3 rounding only for values at or within ulps of a tie; rows this small make gelu(x) ~ x/2,
    # which lands on ties often (3e-4 of the elements with an exact exp, in Triton's interpreter)
    assert (gt.float() != ge.float()).float().mean().item() < 5e-3


def test_scaled_mm_agrees_with_the_emulation():
    x, w = _x(512, 4096, seed=1)[64:-64], torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    x = x / x.float().abs().amax(dim=1, keepdim=True).to(x.dtype)  # rows at comparable scales for the norm
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_rows(x)
    qw, sw = quantize_weight(w)
    got = fp8_gemm(q, s, qw, sw, bias, torch.bfloat16).float()
    ref = ((q.double() * s.double()) @ (qw.double() * sw.double().view(-1, 1)).t() + bias.double()).float()
    # bf16 output rounding (2**-9 relative) dominates fp32 accumulation over 4096 terms
    assert ((got - ref).norm() / ref.norm()).item() < 2.0**-8


def test_fp8_chain_replays_under_cuda_graph_capture():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    up = torch.nn.Linear(1024, 4096, device="cuda", dtype=torch.bfloat16)
    down = torch.nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    qkv = [Fp8Linear.from_linear(lin).load_from(lin) for lin in lins]
    share = SharedInput()
    for lin in qkv:
        lin.share = share
    gelu_up, fp8_down = (
        Fp8GeluProj(Fp8Linear.from_linear(up).load_from(up)),
        Fp8Linear.from_linear(down).load_from(down),
    )
    x = torch.randn(1, 3000, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        q, k, v = (lin(x) for lin in qkv)
        share.clear()
        return q + k + v + fp8_down(gelu_up(x))

    with torch.inference_mode():
        eager = step()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up on the side stream, as torch's capture recipe asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        x.copy_(torch.randn_like(x))
        graph.replay()
        fresh = step()
    assert torch.equal(captured, fresh) and not torch.equal(captured, eager)


@pytest.mark.parametrize(("n", "k", "rank"), [(4096, 4096, 384), (257, 200, 24), (64, 16384, 32)])
def test_triton_lora_fusion_is_bit_identical_to_eager(n, k, rank):
    """`fuse_rowwise` on CUDA runs `triton_lora`'s kernel: the same deltas (one torch GEMM each), the same fp32
    arithmetic and an RNE cast, so the same bytes and scales as the eager fusion, for two factors at once."""
    from ltx_mgpu.fp8.lora import fuse_rowwise, fuse_rowwise_eager

    gen = torch.Generator(device="cuda").manual_seed(n + k + rank)
    q0, s0 = quantize_weight((torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16))
    factors = [
        ((torch.randn(r, k, generator=gen, device="cuda") * 0.01).to(torch.bfloat16),
         (torch.randn(n, r, generator=gen, device="cuda") * 0.01).to(torch.bfloat16), strength)
        for r, strength in ((rank, 0.8), (16, -0.5))
    ]  # fmt: skip
    (qt, st), (qe, se) = fuse_rowwise(q0, s0, factors), fuse_rowwise_eager(q0, s0, factors)
    assert torch.equal(st, se)
    assert torch.equal(qt.view(torch.uint8), qe.view(torch.uint8))
