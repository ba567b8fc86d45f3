"""The fused elementwise kernels (`ltx_mgpu.fused`), checked on the CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, in a child process: the variable must be set before Triton is imported).

The kernels round where eager torch rounds (see `ltx_mgpu.fused.triton_block`), so the residual, modulation and
RoPE steps must be bit-identical to ltx-core's eager expressions, and so must a whole tiny LTX-2 block (split
RoPE, bf16, and with FP8 linears); the norm alone may differ by the derived `NORM_TOLERANCE` (its fp32 mean
of squares is summed in another order), which the 4096-wide rows check.
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


def _within(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> None:
    """|got - want| <= 2 ulps of base + 2 bf16 ulps of want (+ the smallest normal bf16): `ops` module docstring."""
    from ltx_mgpu.fused.ops import NORM_TOLERANCE as t

    bound = 2 * (1 + t) * t * base.float().abs() + 2 * t * want.float().abs() + 2.0**-126
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert (got == want).float().mean().item() > 0.99  # (a flipped rounding is rare)


def interpreter_checks() -> None:
    """Run in the child: kernels against the eager definitions and ltx-core's block."""
    import copy

    from ltx_core.guidance.perturbations import BatchedPerturbationConfig
    from ltx_core.model.transformer.rope import LTXRopeType, apply_split_rotary_emb, precompute_freqs_cis

    from bench.block import DIMS, block_config, block_inputs, build_block
    from ltx_mgpu.fp8 import convert_linears
    from ltx_mgpu.fused import ops
    from ltx_mgpu.fused.block import fuse_elementwise, unfuse_elementwise

    gen = torch.Generator().manual_seed(int(os.environ.get("LTX_TEST_SEED", "11")))
    b, t, d = 2, 6, 4096
    x = torch.randn(b, t, d, generator=gen) * 3
    x[..., ::128] *= 20.0  # outlier channels
    x = x.bfloat16()
    y = torch.randn(b, t, d, generator=gen).bfloat16()
    table = torch.randn(6, d, generator=gen).bfloat16()
    per_token = (torch.randn(b, t, 6, d, generator=gen) * 0.2).bfloat16() + table  # ltx-core's AdaLN sum
    shift, scale, gate = per_token[:, :, :3].unbind(dim=2)  # strided views, as get_ada_values makes them
    bshift, bscale = shift[:, :1], scale[:, :1]  # one value per sample (B, 1, D)
    mask = torch.tensor([1.0, 0.0]).bfloat16().view(2, 1, 1)
    for kw in ({"y": y, "gate": gate, "norm": False}, {"y": y, "gate": gate, "mask": mask, "norm": False},
               {"y": y, "norm": False}):  # fmt: skip
        assert torch.equal(ops.residual_norm(x, **kw, force_kernel=True)[0], ops.residual_norm_eager(x, **kw)[0])
    for kw in ({"scale": scale, "shift": shift}, {"scale": bscale, "shift": bshift}, {},
               {"y": y, "gate": gate, "mask": mask, "scale": scale, "shift": shift}):  # fmt: skip
        (xk, nk), (xe, ne) = ops.residual_norm(x, **kw, force_kernel=True), ops.residual_norm_eager(x, **kw)
        assert torch.equal(xk, xe)
        plain = torch.nn.functional.rms_norm(xe, (d,), eps=1e-6)
        _within(nk, ne, plain * (1 + kw["scale"]) if "scale" in kw else plain)
        assert torch.equal(ne, plain * (1 + kw["scale"]) + kw["shift"] if "scale" in kw else plain)
    # q/k RMSNorm + split RoPE: 32 heads x 128, cos/sin from ltx-core (strided (B, H, T, 64) views)
    q = (torch.randn(1, t, d, generator=gen) * 4).bfloat16()
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16()
    positions = torch.stack([torch.arange(t).float().view(1, t, 1).expand(1, t, 2) for _ in range(3)], dim=1)
    cos, sin = precompute_freqs_cis(positions, d, torch.bfloat16, num_attention_heads=32, rope_type=LTXRopeType.SPLIT)
    normed = torch.nn.functional.rms_norm(q, (d,), weight=weight, eps=1e-6)
    want = apply_split_rotary_emb(normed, cos, sin)
    got = ops.norm_rope(q, weight, cos, sin, 32, force_kernel=True)
    assert torch.equal(ops.norm_rope_eager(q, weight, cos, sin, 32), want)
    # where the kernel's norm rounds like torch's (almost everywhere) the rotation must be exact
    kn = ops.norm_rope(q, weight, None, None, 32, force_kernel=True)
    _within(kn, normed, normed)
    same_rows = (kn == normed).all(dim=-1)
    assert torch.equal(got[same_rows], want[same_rows]) and same_rows.float().mean() > 0.5

    # a whole tiny LTX-2 block (split RoPE as LTX-2's config), bf16 and fp8, fused against ltx-core's forward
    cfg = block_config(DIMS["tiny"])
    cfg["transformer"]["rope_type"] = "split"
    model = build_block(cfg, torch.device("cpu"), torch.bfloat16)
    # 8 video tokens (8 latent frames of 1x1: a 57-frame clip, so 59 audio tokens): every row is its own kernel
    # program, so more rows check nothing new and cost interpreter time
    v, a, _, _ = block_inputs(model, cfg, 8, torch.device("cpu"), torch.bfloat16)
    # one timestep for every token (the runners' for a job without conditioning): (B, 1, D) AdaLN values
    v1, a1, _, _ = block_inputs(model, cfg, 8, torch.device("cpu"), torch.bfloat16, one_timestep=True)
    assert v1.timesteps.shape[1] == 1 and v.timesteps.shape[1] == 8
    pert = BatchedPerturbationConfig.empty(1)
    ops.FORCE_KERNELS = True
    with torch.no_grad():
        bf16_block = model.transformer_blocks[0]
        fp8_block = convert_linears(copy.deepcopy(bf16_block), quantize=True)
        ref1 = bf16_block(v1, a1, pert)
        one = copy.deepcopy(bf16_block)
        fuse_elementwise(one)
        assert all(torch.equal(r.x, o.x) for r, o in zip(ref1, one(v1, a1, pert), strict=True))
        for block in (bf16_block, fp8_block):
            ref = block(v, a, pert)
            fused = copy.deepcopy(block)
            assert fuse_elementwise(fused) == 7  # the block and its six attentions
            out = fused(v, a, pert)
            assert all(torch.equal(r.x, o.x) for r, o in zip(ref, out, strict=True))
            # the Linears are the block's own modules: an in-place weight change (as the LoRA tracker
            # makes) reaches the fused forward
            for blk in (block, fused):
                blk.attn1.to_q.weight.data.mul_(0.5) if blk.attn1.to_q.weight.dtype == torch.bfloat16 else \
                    blk.attn1.to_q.weight_scale.data.mul_(0.5)  # fmt: skip
            ref2, out2 = block(v, a, pert), fused(v, a, pert)
            assert not torch.equal(ref2[0].x, ref[0].x)
            assert all(torch.equal(r.x, o.x) for r, o in zip(ref2, out2, strict=True))
            assert unfuse_elementwise(fused) == 7
    print("interpreter checks passed")


@pytest.mark.timeout(1500)  # (the interpreter runs every kernel program in Python: minutes on a shared CPU)
def test_fused_kernels_and_block_match_eager_in_tritons_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (scripts/setup.sh installs it for this test)")
    pytest.importorskip("ltx_core")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.test_fused_block import interpreter_checks; interpreter_checks()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500, check=False)  # fmt: skip
    assert done.returncode == 0 and "interpreter checks passed" in done.stdout, (done.stdout + done.stderr)[-4000:]


def test_ops_use_eager_code_off_cuda() -> None:
    """Without CUDA (and not forced) the ops are the eager definitions themselves."""
    from ltx_mgpu.fused import ops

    x = torch.randn(1, 4, 64).bfloat16()
    s = torch.randn(1, 1, 64).bfloat16()
    assert torch.equal(
        ops.residual_norm(x, x, s, scale=s, shift=s)[1], ops.residual_norm_eager(x, x, s, scale=s, shift=s)[1]
    )
