"""FP8 e4m3 linears (`ltx_mgpu.fp8`, `quantization="fp8-mm"`) on CPU: the quantization's exact definition,
the GEMM emulation, the layer recipe against ltx-core's, loading from bf16 and fp8 checkpoint layouts, the
fused/shared activation quantization, and LoRA fusion into fp8 weights. Error bounds of whole blocks and of a
denoising loop are in tests/test_fp8_numerics.py; the Triton kernel against this eager code in
tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ltx_mgpu.fp8 import Fp8Linear, fp8_gemm, fp8_layer_names, quantize_rows_eager, quantize_weight
from ltx_mgpu.fp8 import linear as fp8_linear
from ltx_mgpu.fp8.linear import Fp8GeluProj
from ltx_mgpu.fp8.rowwise import E4M3_MAX, gelu_tanh
from ltx_mgpu.runners.ltx2 import components as comp

E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: round-to-nearest moves a normal value by <= 2**-4 of itself


def _reference_exponent(amax: float) -> int:
    """The smallest e with amax <= 448 * 2**e, by exact float64 comparisons (448 * 2**e is exact)."""
    if amax == 0.0:
        return 0
    e = math.frexp(amax / E4M3_MAX)[1]  # an estimate within one of the answer
    while amax > E4M3_MAX * 2.0**e:
        e += 1
    while amax <= E4M3_MAX * 2.0 ** (e - 1):
        e -= 1
    return max(-126, min(126, e))


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen)
    x *= torch.logspace(-20, 20, 40, base=2.0).view(-1, 1)  # rows across 40 binades
    x[0] = 0.0
    x[1, 0] = 448.0  # exactly at the top: scale 1
    x[2, 0] = 448.0 * (1 + 2**-20)  # just above: scale 2
    x[3, 0] = -448.0 * 2**-7
    return x


def test_activation_scale_is_the_smallest_power_of_two_and_q_is_the_rounded_quotient():
    x = _rows()
    q, scale = quantize_rows_eager(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (40, 1) and scale.dtype == torch.float32
    expected = [2.0 ** _reference_exponent(a) for a in x.abs().amax(dim=1).tolist()]
    assert scale.squeeze(1).tolist() == expected
    assert scale[1].item() == 1.0 and scale[2].item() == 2.0 and scale[3].item() == 2.0**-7
    # the quotient by a power of two is exact, so q is one rounding (to nearest even) of x / scale
    exact = (x.double() / torch.tensor(expected, dtype=torch.float64).view(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    assert torch.equal(q.view(torch.uint8), exact.float().to(torch.float8_e4m3fn).view(torch.uint8))
    assert q[0].float().abs().sum() == 0 and scale[0].item() == 1.0


def test_rounding_is_within_2_pow_minus_4_for_every_normal_element():
    x = _rows()
    q, scale = quantize_rows_eager(x.to(torch.bfloat16))
    xb = x.to(torch.bfloat16).float()
    back = q.float() * scale
    normal = xb.abs() >= scale * 2.0**-6  # e4m3's smallest normal is 2**-6; below it the step is absolute
    rel = ((back - xb).abs() / xb.abs().clamp_min(1e-30))[normal]
    assert rel.max().item() <= E4M3_REL
    assert rel.max().item() > E4M3_REL / 4  # it did round to 3 bits (bf16's 7 bits would be 2**-8)


def test_weight_scales_are_per_output_channel():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 80, generator=gen) * torch.logspace(-4, 4, 48, base=10.0).view(-1, 1)
    q, scale = quantize_weight(w.to(torch.bfloat16))
    assert scale.shape == (48,) and q.shape == (48, 80)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), E4M3_MAX))  # each row's max at 448
    wb = w.to(torch.bfloat16).float()
    back = q.float() * scale.view(-1, 1)
    normal = wb.abs() >= scale.view(-1, 1) * 2.0**-6
    assert (((back - wb).abs() / wb.abs())[normal]).max().item() <= E4M3_REL * (1 + 2**-20)


def test_gemm_emulation_is_the_exactly_dequantized_product():
    gen = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(24, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32)
    qx, sx = quantize_rows_eager(x)
    qw, sw = quantize_weight(w)
    out = fp8_gemm(qx, sx, qw, sw, bias.to(torch.bfloat16), torch.float32)
    ref = (qx.double() * sx.double()) @ (qw.double() * sw.double().view(-1, 1)).t() + bias.to(torch.bfloat16).double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 accumulation of 64 terms


def test_the_scaled_mm_call_computes_what_the_emulation_computes():
    """The GPU path's `torch._scaled_mm` call, run by torch's CPU implementation: the same operand layout,
    scale shapes and bias semantics as the emulation (bit for bit in torch 2.13's CPU build)."""
    from ltx_mgpu.fp8.linear import scaled_mm_rowwise

    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    bias = torch.randn(32, generator=gen).bfloat16()
    qx, sx = quantize_rows_eager(x)
    qw, sw = quantize_weight(w)
    try:
        got = scaled_mm_rowwise(qx, sx, qw, sw, bias, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch build has no CPU _scaled_mm: {exc}")
    ref = fp8_gemm(qx, sx, qw, sw, bias, torch.bfloat16)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 2.0**-8  # bf16 output rounding


def test_gelu_matches_torch_tanh_gelu():
    x = torch.linspace(-12, 12, 2001)
    assert torch.allclose(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)


# ---- the recipe and loading ----------------------------------------------------------------------------
def _meta_model(num_layers: int) -> torch.nn.Module:
    from ltx_core.model.transformer import LTXModelConfigurator

    from ltx_mgpu.runners.common.tiny import tiny_transformer_config

    with torch.device("meta"):
        return LTXModelConfigurator.from_config(tiny_transformer_config(num_layers=num_layers))


def test_recipe_is_ltx_cores_fp8_scaled_mm_recipe_on_the_48_block_model():
    import ltx_core.loader  # noqa: F401
    from ltx_core.quantization.fp8_scaled_mm import FP8_PREPARE_MODULE_OPS, FP8Linear

    theirs = FP8_PREPARE_MODULE_OPS.mutator(_meta_model(48))
    expected = {n for n, m in theirs.named_modules() if isinstance(m, FP8Linear)}
    ours = comp.quantization_policy("fp8-mm").module_ops[0].mutator(_meta_model(48))
    converted = {n for n, m in ours.named_modules() if isinstance(m, Fp8Linear)}
    assert converted == expected and len(converted) > 42 * 8
    blocks = {int(n.split(".")[1]) for n in converted}
    assert blocks == set(range(1, 43))  # blocks 0 and 43-47 stay bf16, as do the top-level projections
    assert not any(n.startswith(("proj_out", "patchify_proj", "adaln_single", "caption_projection")) for n in converted)


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


def _build(checkpoint: str, quantization: str | None) -> torch.nn.Module:
    tb = comp.transformer_builder(checkpoint, quantization=comp.quantization_policy(quantization))
    return tb.build(device=torch.device("cpu"), dtype=None if quantization else torch.bfloat16).eval()


def test_bf16_checkpoint_is_quantized_at_load_per_channel(tiny):
    from safetensors import safe_open

    model = _build(str(tiny.checkpoint), "fp8-mm")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert set(layers) == set(fp8_layer_names(model)) and all(n.startswith("transformer_blocks.1.") for n in layers)
    with safe_open(str(tiny.checkpoint), framework="pt") as f:
        for name, layer in layers.items():
            q, scale = quantize_weight(f.get_tensor(f"model.diffusion_model.{name}.weight"))
            assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                layer.weight_scale, scale
            )
    comp.check_quantized(model, "fp8-mm")
    with pytest.raises(RuntimeError, match="no transformer Linear computes in fp8"):
        comp.check_quantized(_build(str(tiny.checkpoint), None), "fp8-mm")


def _fp8_file(tiny, path, *, also: str | None = None) -> None:
    """The tiny monolith in the published fp8 layout: each recipe layer's weight (out, in) in e4m3 with a
    0-d `weight_scale` (the dequantization multiplier) and a 0-d `input_scale`; `also`: one more layer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    names = set(fp8_layer_names(_build(str(tiny.checkpoint), None))) | ({also} if also else set())
    out = {}
    with safe_open(str(tiny.checkpoint), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():
            out[key] = f.get_tensor(key)
            layer = key[len("model.diffusion_model.") : -len(".weight")]
            if key.endswith(".weight") and layer in names:
                w = out[key].float()
                scale = w.abs().amax() / E4M3_MAX
                out[key] = (w / scale).to(torch.float8_e4m3fn)
                out[f"model.diffusion_model.{layer}.weight_scale"] = scale.reshape(())
                out[f"model.diffusion_model.{layer}.input_scale"] = torch.tensor(0.05)
    save_file(out, str(path), metadata=meta)


def test_published_fp8_layout_loads_with_the_files_scales(tiny, tmp_path):
    _fp8_file(tiny, tmp_path / "fp8.safetensors")
    model = _build(str(tmp_path / "fp8.safetensors"), "fp8-mm")
    layer = model.transformer_blocks[1].ff.net[2]
    assert isinstance(layer, Fp8Linear) and layer.weight_scale.shape == (layer.out_features,)
    assert torch.unique(layer.weight_scale).numel() == 1  # one file scale, widened per channel
    assert not any(n.endswith("input_scale") for n, _ in model.named_parameters())
    bf16 = _build(str(tiny.checkpoint), None)
    got = layer.weight.float() * layer.weight_scale.view(-1, 1)
    ref = bf16.transformer_blocks[1].ff.net[2].weight.float()
    normal = ref.abs() >= got.abs().amax() * 2.0**-8 * 2.0**-6 * 448  # clear of e4m3's subnormals
    assert (((got - ref).abs() / ref.abs())[normal]).max().item() <= E4M3_REL * (1 + 2**-20)
    _fp8_file(tiny, tmp_path / "bad.safetensors", also="transformer_blocks.0.attn1.to_q")
    with pytest.raises(ValueError, match="recipe keeps it in bf16"):
        _build(str(tmp_path / "bad.safetensors"), "fp8-mm")


# ---- fused and shared activation quantization ---------------------------------------------------------
def _count_quantizations(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = fp8_linear.quantize_rows

    def counting(x, **kw):
        calls.append(x.shape[0])
        return real(x, **kw)

    monkeypatch.setattr(fp8_linear, "quantize_rows", counting)
    return calls


def test_attention_projections_share_one_quantization_per_input(tiny, monkeypatch):
    model = _build(str(tiny.checkpoint), "fp8-mm")
    block = model.transformer_blocks[1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 50, 192, generator=gen).to(torch.bfloat16)
    ctx = torch.randn(1, 7, 192, generator=gen).to(torch.bfloat16)
    calls = _count_quantizations(monkeypatch)
    with torch.inference_mode():
        self_out = block.attn1(x)
        assert calls == [50, 50]  # x once for q, k and v; the attention output once for to_out
        calls.clear()
        cross_out = block.attn2(x, context=ctx)
        assert sorted(calls) == [7, 50, 50]  # context once (k, v), x once (q), the output once
        calls.clear()
        hidden = block.ff(x)
        assert isinstance(block.ff.net[0], Fp8GeluProj)
        assert calls == [50, 50]  # x for the up projection; gelu(up) fused for the down projection
        for attn in (block.attn1, block.attn2):
            for lin in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]):
                lin.share = None  # every projection quantizes its own input
        assert torch.equal(block.attn1(x), self_out) and torch.equal(block.attn2(x, context=ctx), cross_out)
        up = block.ff.net[0].proj
        h = up(x)
        q, s = quantize_rows_eager(h.reshape(-1, h.shape[-1]), gelu=True)
        down = block.ff.net[2]
        assert torch.equal(fp8_gemm(q, s, down.weight, down.weight_scale, down.bias, h.dtype).view(1, 50, -1), hidden)


def test_no_quantized_input_outlives_its_attention(tiny):
    """A share's entries live from an attention's first input projection to its output projection, which must
    not file its own input there: an entry left behind outlives the forward, one per attention of every
    block (on the 19B model at 63,240 tokens about 27 GiB, which an H100 job ran out of memory on)."""
    model = _build(str(tiny.checkpoint), "fp8-mm")
    block = model.transformer_blocks[1]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 50, 192, generator=gen).to(torch.bfloat16)
    ctx = torch.randn(1, 7, 192, generator=gen).to(torch.bfloat16)
    audio = torch.randn(1, 13, 96, generator=gen).to(torch.bfloat16)
    shares = {id(m.share): m.share for m in model.modules() if isinstance(m, Fp8Linear) and m.share is not None}
    called = [block.attn1, block.attn2, block.audio_attn1, block.audio_to_video_attn, block.video_to_audio_attn]
    assert len(shares) >= len(called)
    with torch.inference_mode():
        block.attn1(x)
        block.attn2(x, context=ctx)
        block.audio_attn1(audio)
        block.audio_to_video_attn(x, context=audio)
        block.video_to_audio_attn(audio, context=x)
    held = {n: len(m.to_q.share._entries) for n, m in block.named_children() if m in called}
    assert held == dict.fromkeys(held, 0) and len(held) == len(called)
    assert all(not share._entries for share in shares.values())


def test_lora_fuses_into_fp8_weights_and_reset_restores_their_bytes(tiny, tmp_path):
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

    from ltx_mgpu.fp8.lora import fuse_rowwise
    from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker
    from tests.test_lora_tracker import write_lora

    model = _build(str(tiny.checkpoint), "fp8-mm")
    lora = write_lora(tmp_path / "l.safetensors", tiny.checkpoint, seed=5, every=1)
    layer = model.transformer_blocks[1].attn1.to_q
    clean_q, clean_s = layer.weight.clone(), layer.weight_scale.clone()
    tracker = LoraWeightTracker()
    tracker.attach(model)
    tracker.apply([LoraSpec(str(lora), 0.7, LTXV_LORA_COMFY_RENAMING_MAP)])
    from safetensors import safe_open

    with safe_open(str(lora), framework="pt") as f:
        a = f.get_tensor("diffusion_model.transformer_blocks.1.attn1.to_q.lora_A.weight")
        b = f.get_tensor("diffusion_model.transformer_blocks.1.attn1.to_q.lora_B.weight")
    q, s = fuse_rowwise(clean_q, clean_s, [(a, b, 0.7)])
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
    assert not torch.equal(layer.weight.view(torch.uint8), clean_q.view(torch.uint8))
    tracker.reset()
    assert torch.equal(layer.weight.view(torch.uint8), clean_q.view(torch.uint8)) and torch.equal(
        layer.weight_scale, clean_s
    )


def test_fusing_a_lora_into_fp8_stays_within_the_fused_weights_own_e4m3_rounding():
    """The fp8 fusion makes its delta as ltx-core does for fp8 weights (the product in the LoRA's dtype, then
    bf16) and re-quantizes in place. Against the exact fp32 fusion, each element may differ by: e4m3's
    round-to-nearest of the fused value, 2**-4 of it (3 mantissa bits) or, below the normal range (2**-6 of
    the row's scale), half the smallest subnormal step (2**-10 of the scale); plus the delta's two bf16
    roundings (`b * strength`, then the product: 2**-8 of |b * strength| @ |a| in all), moved by at most one
    e4m3 step more where they cross a rounding boundary (another 2**-3 of the value)."""
    from ltx_mgpu.fp8.lora import fuse_rowwise

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    a = (torch.randn(8, 96, generator=gen) * 0.5).to(torch.bfloat16)
    b = (torch.randn(64, 8, generator=gen) * 0.5).to(torch.bfloat16)
    q0, s0 = quantize_weight(w)
    before = (q0.clone(), s0.clone())
    q, scale = fuse_rowwise(q0, s0, [(a, b, 0.7)])
    assert torch.equal(q0.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(s0, before[1])  # inputs kept
    exact = q0.float() * s0.view(-1, 1) + (b.float() * 0.7) @ a.float()
    got = q.float() * scale.view(-1, 1)
    bound = (
        (3 * 2.0**-4) * exact.abs() + 2.0**-10 * scale.view(-1, 1) + 2.0**-8 * (b.float().abs() * 0.7) @ a.float().abs()
    )
    assert (got - exact).abs().le(bound).all()
    assert not torch.equal(q.view(torch.uint8), q0.view(torch.uint8))  # the LoRA changed the weight


def test_weight_quantization_leaves_an_fp32_input_untouched():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    kept = w.clone()
    q, scale = quantize_weight(w)
    assert torch.equal(w, kept)
    assert (q.float() * scale.view(-1, 1) - w).abs().le(2.0**-4 * w.abs() + 2.0**-10 * scale.view(-1, 1)).all()


def test_bench_runs_its_cpu_smoke_version():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "bench.fp8", "--device", "cpu", "--dims", "tiny", "--tokens", "96",
           "--iters", "1", "--warmup", "0"]  # fmt: skip
    for block in ("ltx", "standin"):
        done = subprocess.run(
            [*cmd, "--block", block, *(["--sdpa", "flash"] if block == "ltx" else [])],
            capture_output=True, text=True, timeout=240, cwd=root, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.strip().splitlines()
        rows = [json.loads(line) for line in lines[:-1]]
        assert lines[-1].startswith("SUMMARY") and "linears" in lines[-1]
        kinds = [r["kind"] for r in rows]
        assert rows[0]["sdpa"] == ("flash" if block == "ltx" else "default")  # the backend every SDPA used
        assert kinds.count("gemm") == 3 and {"env", "check", "linears", "block"} <= set(kinds)
        assert next(r for r in rows if r["kind"] == "check")["quantize_bitwise_equal_to_eager"] is True
        block_row = next(r for r in rows if r["kind"] == "block")
        assert block_row["block"] == block and 0 < block_row["rel_err_video"] < 0.03


def test_e2e_bench_passes_the_quantization_to_the_runners_setup(monkeypatch):
    from bench.e2e import runs as e2e

    args = e2e.parse_args(["--quantization", "fp8-mm"])
    seen = {}

    def stop(runner, profile, weights):
        seen.update(weights)
        raise SystemExit("stop")

    monkeypatch.setattr(e2e, "make_workload", stop)
    with pytest.raises(SystemExit, match="stop"):
        e2e.run(None, e2e.specs_from(args)[0], args, {"checkpoint_path": "x"}, None, None, None)
    assert seen == {"checkpoint_path": "x", "quantization": "fp8-mm"}


def test_fp8_mm_on_a_gpu_without_fp8_tensor_cores_fails_setup(monkeypatch):
    """Setup checks the GPU before any weight loads (`components.check_gpu`, the worker's table): an sm_80 GPU
    (an A100, faked: nothing touches CUDA) refuses `fp8-mm` and says what to use instead; sm_89 takes it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="needs FP8 tensor cores .* use 'fp8-cast'"):
        comp.check_gpu("fp8-mm", torch.device("cuda", 0))
    comp.check_gpu(None, torch.device("cuda", 0))
    comp.check_gpu("fp8-mm", torch.device("cpu"))  # (CPU ranks: the emulation is the path)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    comp.check_gpu("fp8-mm", torch.device("cuda", 0))
