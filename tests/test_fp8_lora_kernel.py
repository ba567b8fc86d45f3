"""The Triton kernel of the FP8 LoRA fusion (`ltx_mgpu.fp8.triton_lora`), checked on the CPU through Triton's
interpreter (`TRITON_INTERPRET=1`, in a child process: the variable must be set before Triton is imported).

The kernel promises the eager fusion's arithmetic step for step, so up to the final e4m3 cast its values and
its scales must be bit-identical to `fuse_rowwise_eager`'s (the same deltas from the same torch GEMM, then
fp32 multiplies, adds and IEEE divisions in the same order): no tolerance. The cast itself is not checked
here: the interpreter rounds it wrongly where rounding carries into the exponent (-31.36 came out -16), and
on a GPU it is one `cvt.rn.satfinite.e4m3x2.f32` per pair, checked by tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.numerics


def _eager_uncast(q0: torch.Tensor, s0: torch.Tensor, factors: list) -> tuple[torch.Tensor, torch.Tensor]:
    """`fuse_rowwise_eager` stopped before its cast: the clamped fp32 values and the scales."""
    fused = q0.to(torch.float32).mul_(s0.view(-1, 1))
    for a, b, strength in factors:
        fused.add_(torch.matmul(b * float(strength), a).to(torch.bfloat16))
    amax = fused.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return fused.div_(scale[:, None]).clamp_(-448.0, 448.0), scale


def interpreter_checks() -> None:
    """Run in the child (`TRITON_INTERPRET=1`): every case must match the eager code bit for bit."""
    from ltx_mgpu.fp8.lora import fuse_rowwise_eager
    from ltx_mgpu.fp8.rowwise import quantize_weight
    from ltx_mgpu.fp8.triton_lora import fuse_rowwise_triton

    gen = torch.Generator().manual_seed(int(os.environ.get("LTX_TEST_SEED", "7")))
    for n, k, ranks, strengths in [(96, 200, (24,), (0.7,)), (33, 1000, (16, 40), (0.5, -1.3)), (5, 7, (3,), (2.0,))]:
        w = torch.randn(n, k, generator=gen) * torch.logspace(-6, 2, n, base=2.0).view(-1, 1)
        w[1] = 0.0  # a zero row: scale 1 unless a delta makes it non-zero
        q0, s0 = quantize_weight(w.to(torch.bfloat16))
        factors = [((torch.randn(r, k, generator=gen) * 0.2).to(torch.bfloat16),
                    (torch.randn(n, r, generator=gen) * 0.2).to(torch.bfloat16), st)
                   for r, st in zip(ranks, strengths, strict=True)]  # fmt: skip
        factors[0][1][1] = 0.0  # ... and for the first factor it stays zero there
        before = (q0.clone(), s0.clone())
        got, scale = fuse_rowwise_triton(q0, s0, factors, uncast=True)
        want, want_scale = _eager_uncast(q0, s0, factors)
        assert torch.equal(q0.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(s0, before[1])
        assert torch.equal(scale, want_scale), (n, k, (scale - want_scale).abs().max())
        assert torch.equal(got, want), (n, k, (got != want).sum())
        assert torch.equal(scale, fuse_rowwise_eager(q0, s0, factors)[1])  # (the eager code's own scales)
    print("interpreter checks passed")


def test_fused_lora_kernel_matches_the_eager_fusion_in_tritons_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (scripts/setup.sh installs it for this test)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.test_fp8_lora_kernel import interpreter_checks; interpreter_checks()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0 and "interpreter checks passed" in done.stdout, (done.stdout + done.stderr)[-4000:]


def test_fuse_rowwise_uses_the_eager_code_off_cuda() -> None:
    """On the CPU (and for factors that are not bf16) `fuse_rowwise` is the eager definition itself."""
    from ltx_mgpu.fp8.lora import fuse_rowwise, fuse_rowwise_eager
    from ltx_mgpu.fp8.rowwise import quantize_weight

    gen = torch.Generator().manual_seed(3)
    q0, s0 = quantize_weight(torch.randn(16, 48, generator=gen).to(torch.bfloat16))
    factors = [(torch.randn(4, 48, generator=gen), torch.randn(16, 4, generator=gen), 0.5)]  # (fp32 factors)
    (q, s), (qe, se) = fuse_rowwise(q0, s0, factors), fuse_rowwise_eager(q0, s0, factors)
    assert torch.equal(q.view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s, se)


def test_fp8_lora_bench_cpu_smoke() -> None:
    """`python -m bench.fp8_lora` on the CPU: the eager fusion timed per shape and rank, a SUMMARY line (the kernel's
    columns need CUDA)."""
    import json

    cmd = [sys.executable, "-m", "bench.fp8_lora", "--device", "cpu", "--shapes", "96x200",
           "--ranks", "16,384", "--iters", "1", "--warmup", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]
    assert rows[0]["kind"] == "meta" and rows[0]["kernels"] is False
    assert [(r["shape"], r["rank"]) for r in rows[1:]] == [("96x200", 16), ("96x200", 384)]
    assert all(r["eager_ms"] > 0 for r in rows[1:])
    assert lines[-1].startswith("SUMMARY ") and json.loads(lines[-1].removeprefix("SUMMARY "))["kernels"] is False


def test_weight_scales_divide_by_a_tensor_not_a_python_number() -> None:
    """The weight scales `amax / 448` must be IEEE divisions on every device, as the kernel's `div_rn` is. On CUDA
    torch computes `tensor / python_scalar` (and `/ 0-dim CPU tensor`) as a multiplication by the fp32 reciprocal
    (one ulp off for some amax: the H200 failure of tests/test_fp8_gpu.py::test_triton_lora_fusion_is_bit_identical
    _to_eager); on the CPU both are exact, so this checks the divisors the eager code dispatches instead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ltx_mgpu.fp8.lora import fuse_rowwise_eager
    from ltx_mgpu.fp8.rowwise import quantize_weight

    divisors: list[object] = []

    class Divisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor, torch.ops.aten.div.Scalar):
                divisors.append(args[1])
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    with Divisions():
        q0, s0 = quantize_weight(w)
        fuse_rowwise_eager(q0, s0, [(torch.randn(2, 32, generator=gen), torch.randn(8, 2, generator=gen), 0.5)])
    assert len(divisors) >= 4  # (two per quantization: amax / 448, w / scale)
    assert all(isinstance(d, torch.Tensor) and d.dim() > 0 for d in divisors), divisors
    # the reciprocal product really differs from the division for some amax (so the distinction matters)
    amax = torch.linspace(1.0, 2.0, 4097, dtype=torch.float32)
    assert not torch.equal(amax / torch.full_like(amax, 448.0), amax * (1.0 / torch.tensor(448.0)))
