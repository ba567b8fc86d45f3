"""FP8 attention (`ltx_mgpu.fp8.attention`, `quantization="fp8-mm+attn"`) on CPU: the scales, the q/k bound
from RMSNorm + RoPE, the emulation's error against fp32 attention derived from e4m3's 3 mantissa bits, the
composition with SP's attention wrapper, the quantization setting and the tiny model. The cuDNN and
SageAttention kernels against fp32 attention: tests/test_fp8_attention_gpu.py.

How e4m3 rounding propagates through attention (first order; rho^2 = (2**-4)^2 / 3, the variance of a
relative rounding error spread uniformly up to 2**-4: an upper model, since over a binade the relative error
shrinks towards 2**-5, which makes the real variance ~0.54 rho^2). With P = softmax(c q k^T), O = P v,
c = 1/sqrt(D), each output element O_id receives, from independent roundings:
- q_i's: dO_i = c sum_e dq_ie C_i[e, :], C_i = sum_j P_ij k_j (v_j - O_i)^T (how scores move the average):
  variance rho^2 c^2 sum_e q_ie^2 C_i[e, d]^2;
- each k_j's: rho^2 c^2 sum_j P_ij^2 (sum_e q_ie^2 k_je^2) (v_jd - O_id)^2;
- each v_j's: rho^2 sum_j P_ij^2 v_jd^2; the kernel's rounding of P (relative, before P.V, the row sum from
  the unrounded P): the same again; the output's own rounding: rho^2 O_id^2.
The predicted relative error is sqrt(sum of the variances / sum O^2). For zero-mean random v (outputs that
cancel) it is ~ rho * sqrt(5) ~ 0.08; for v with a common component, much less, and less again with v's mean
over the tokens m taken out before the casts (the default): the v, P and output terms then see v_j - m and
O_i - m (the q and k terms are unchanged: they see v_j - O_i). The tests require the
emulation's error to lie between 0.5 and 1.0 times the prediction: below 1 because the model is an upper
one, above 0.5 because a quantizer that did nothing (or kept more bits) would fall far below it.
"""

from __future__ import annotations

import math

import pytest
import torch

from ltx_mgpu.fp8 import attention as fa

RHO2 = (2.0**-4) ** 2 / 3
RHO2_BF16 = (2.0**-8) ** 2 / 3  #: the same upper model for bf16's 7 mantissa bits


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, t, hidden = x.shape
    return x.view(b, t, h, hidden // h).transpose(1, 2).double()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return p, p @ v


def predicted_rel_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_v: bool = True, bf16_out: bool = False
) -> float:
    """The module docstring's first-order prediction for (B, H, T, D) float64 q, k, v; `smooth_v`: v's mean
    over the tokens m is taken out before the roundings (the attention's default), so the v, P and output
    roundings act on v - m and O - m (the q and k terms already see only v_j - O_i). `bf16_out`: the result is
    returned in bf16, one more rounding of the whole O (7 mantissa bits: RHO2_BF16 O^2), negligible beside e4m3's
    but the floor once the shift has taken the rest away."""
    c = 1.0 / math.sqrt(q.shape[-1])
    p, o = _attention(q, k, v)
    norm2 = (o * o).sum().item()
    if smooth_v:
        m = v.mean(dim=-2, keepdim=True)
        v, o = v - m, o - m
    p2 = p * p
    cov = torch.einsum("bhij,bhje,bhjd->bhied", p, k, v) - (p @ k).unsqueeze(-1) * o.unsqueeze(-2)
    var_q = c * c * torch.einsum("bhie,bhied->bhid", q * q, cov * cov)
    dv = v.unsqueeze(-3) - o.unsqueeze(-2)  # (b, h, i, j, d): v_j - O_i
    var_k = c * c * torch.einsum("bhij,bhijd->bhid", p2 * ((q * q) @ (k * k).transpose(-1, -2)), dv * dv)
    var_v = p2 @ (v * v)
    total = RHO2 * (var_q + var_k + 2 * var_v + o * o)
    return math.sqrt(total.sum().item() / norm2 + (RHO2_BF16 if bf16_out else 0.0))


def _data(kind: str, b: int = 1, t: int = 192, h: int = 4, d: int = 32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(hash(kind) % 2**31)
    norm = torch.nn.RMSNorm(h * d)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h * d, generator=gen) + 0.5)
    q, k, v = (torch.randn(b, t, h * d, generator=gen) for _ in range(3))
    if kind == "peaked":  # larger scores: attention concentrated on few keys
        q = q * 3.0
    if kind == "offset":  # values with a common component: outputs do not cancel
        v = v + 2.0
    with torch.no_grad():
        q, k = norm(q), norm(k)
    return q, k, v, norm


# ---- scales ---------------------------------------------------------------------------------------------
def test_scales_are_the_smallest_powers_of_two_that_fit_448():
    amax = torch.tensor([0.0, 448.0, 448.0 * (1 + 2**-20), 1.0, 3.0e-30, 6.0e30, 224.0, 224.0 * (1 + 2**-20)])
    scale, inv = fa.pow2_scales(amax)
    want = []
    for a in amax.tolist():
        e = 0 if a == 0 else math.ceil(math.log2(a / 448.0))
        while a and a > 448.0 * 2.0**e:
            e += 1
        while a and a <= 448.0 * 2.0 ** (e - 1):
            e -= 1
        want.append(2.0 ** max(-126, min(126, e)))
    assert scale.tolist() == want and torch.equal(scale * inv, torch.ones_like(scale))
    assert scale[1] == 1.0 and scale[2] == 2.0 and scale[6] == 0.5 and scale[7] == 1.0


@pytest.mark.parametrize("rope", ["interleaved", "split"])
def test_q_k_never_exceed_the_bound_read_from_the_rmsnorm_weight(rope):
    """|RoPE(RMSNorm(y))| <= sqrt(n) max|w|, reached when a row puts all its energy on one pair."""
    from ltx_core.model.transformer.rope import LTXRopeType, apply_rotary_emb

    n, t = 64, 6
    gen = torch.Generator().manual_seed(1)
    norm = torch.nn.RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=gen) * 3)
    y = torch.randn(1, t, n, generator=gen)
    y[0, 0] = 0.0
    y[0, 0, 0] = 5.0  # all energy in the first element: |normalised| = sqrt(n) there
    pair = 1 if rope == "interleaved" else n // 2  # the element RoPE rotates element 0 with
    with torch.no_grad():
        norm.weight[0] = norm.weight.abs().max() + 1.0
        norm.weight[pair] = norm.weight[0]
    angles = torch.rand(1, t, n // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    if rope == "interleaved":
        cos = angles.cos().repeat_interleave(2, dim=-1).float()
        sin = angles.sin().repeat_interleave(2, dim=-1).float()
        kind = LTXRopeType.INTERLEAVED
    else:
        cos, sin = angles.cos().float().unsqueeze(1), angles.sin().float().unsqueeze(1)  # (B, 1 head, T, n/2)
        kind = LTXRopeType.SPLIT
    with torch.no_grad():
        x = apply_rotary_emb(norm(y), (cos, sin), kind)
    bound = fa.qk_bound(norm, n, torch.device("cpu"))
    assert x.abs().max() <= bound * (1 + 1e-6)
    assert x[0, 0].abs().max() >= 0.7 * bound  # the bound is reached, up to the rotation's split


def test_quantization_error_is_within_half_a_step_of_e4m3():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4096, generator=gen) * torch.logspace(-12, 4, 4096, base=2.0)
    scale, inv = fa.pow2_scales(x.abs().amax())
    dq = fa.quantize(x, inv).float() * scale
    allowed = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10) * scale)  # normal / subnormal
    assert ((dq - x).abs() <= allowed).all()
    assert (dq - x).abs().max() > 0  # it did round


# ---- the emulation against fp32 attention ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "peaked", "offset"])
@pytest.mark.parametrize("static_qk", [True, False])
def test_emulated_fp8_attention_error_matches_the_e4m3_prediction(kind, static_qk):
    q, k, v, norm = _data(kind)
    h = 4
    attn = fa.Fp8SelfAttention(lambda *a: None, norm if static_qk else None, norm if static_qk else None, "emulate")
    with torch.no_grad():
        out = attn(q, k, v, h)
    _, ref = _attention(_heads(q, h), _heads(k, h), _heads(v, h))
    ref = ref.transpose(1, 2).reshape(out.shape)
    measured = ((out.double() - ref).norm() / ref.norm()).item()
    predicted = predicted_rel_error(_heads(q, h), _heads(k, h), _heads(v, h))
    print(f"{kind} static_qk={static_qk}: measured {measured:.4f}, predicted {predicted:.4f}")
    assert 0.5 * predicted <= measured <= predicted, (kind, measured, predicted)


def test_the_value_shift_takes_the_common_component_out_of_the_rounding():
    """v with a common component (the synthetic 19B block's has one): without the shift the output's e4m3
    rounding lands on it, with it only on what is left; each side within its own prediction, and the shift alone
    (no rounding) is exact."""
    q, k, v, norm = _data("offset")
    h = 4
    _, ref = _attention(_heads(q, h), _heads(k, h), _heads(v, h))
    ref = ref.transpose(1, 2).reshape(q.shape)
    errors = {}
    for smooth in (False, True):
        attn = fa.Fp8SelfAttention(lambda *a: None, norm, norm, "emulate", smooth_v=smooth)
        with torch.no_grad():
            out = attn(q, k, v, h)
        errors[smooth] = ((out.double() - ref).norm() / ref.norm()).item()
        predicted = predicted_rel_error(_heads(q, h), _heads(k, h), _heads(v, h), smooth_v=smooth)
        assert 0.5 * predicted <= errors[smooth] <= predicted, (smooth, errors[smooth], predicted)
    assert errors[True] < errors[False] / 4, errors
    m = fa.value_shift(v).double()  # (any shift would do: rows of P sum to 1; checked in float64)
    heads = [_heads(x, h) for x in (q, k, v.double() - m)]
    shifted = _attention(*heads)[1].transpose(1, 2).reshape(q.shape) + m
    assert torch.allclose(shifted, ref, rtol=0, atol=1e-12 * ref.abs().max().item())


def test_emulation_without_roundings_is_fp32_attention():
    q, k, v, _ = _data("random", t=64)
    ones = torch.ones(3)
    got = fa.emulate_fp8_attention(
        *(_heads(x, 4).float().to(torch.float8_e4m3fn) for x in (q / 4, k / 4, v / 4)), ones * 4,
        quantize_p=False, quantize_o=False, block=16,
    )  # fmt: skip
    rounded = [_heads(x / 4, 4).float().to(torch.float8_e4m3fn).double() * 4 for x in (q, k, v)]
    assert torch.allclose(got.double(), _attention(*rounded)[1], rtol=1e-5, atol=1e-6)


def test_a_masked_call_runs_the_attention_it_replaced():
    calls = []

    def bf16(q, k, v, heads, mask=None):
        calls.append(mask)
        return q

    q, k, v, norm = _data("random", t=16)
    mask = torch.zeros(1, 1, 1, 16)
    assert fa.Fp8SelfAttention(bf16, norm, norm, "emulate")(q, k, v, 4, mask) is q and calls == [mask]


def test_auto_runs_fp8_only_from_the_token_count_where_it_wins():
    """`auto` on CUDA sends calls over fewer than `FP8_ATTENTION_MIN_TOKENS` keys to the bf16 attention (FP8 was
    0.45x its speed at 1,536 tokens, 1.22x at 6,144); the emulation has no floor (it is there for numerics), and
    a backend asked for by name always runs FP8."""
    calls = []

    def bf16(q, k, v, heads, mask=None):
        calls.append(q.shape[1])
        return q

    auto = fa.Fp8SelfAttention(bf16)
    assert not auto.runs_fp8(fa.FP8_ATTENTION_MIN_TOKENS - 1, on_cuda=True)
    assert auto.runs_fp8(fa.FP8_ATTENTION_MIN_TOKENS, on_cuda=True) and auto.runs_fp8(1, on_cuda=False)
    assert all(fa.Fp8SelfAttention(bf16, backend=b).runs_fp8(1, on_cuda=True) for b in ("cudnn", "emulate", "sage"))
    assert 1536 < fa.FP8_ATTENTION_MIN_TOKENS < 6144  # between the measured shapes where it lost and won
    q, k, v, norm = _data("random", t=16)
    floored = fa.Fp8SelfAttention(bf16, norm, norm, "auto", min_tokens=17)  # on CPU auto is the emulation
    assert floored(q, k, v, 4) is q and calls == [16]
    out = fa.Fp8SelfAttention(bf16, norm, norm, "auto", min_tokens=16)(q, k, v, 4)
    assert out is not q and out.shape == q.shape and calls == [16]  # the emulated FP8 path, not the fallback
    with pytest.raises(ValueError, match="min_tokens"):
        fa.Fp8SelfAttention(bf16, min_tokens=-1)


# ---- composition ---------------------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from ltx_core.model.transformer.attention import Attention

        self.attn1 = Attention(query_dim=64, heads=4, dim_head=16)


class _Model(torch.nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(_Block() for _ in range(blocks))


@pytest.mark.parametrize("order", ["fp8-then-sp", "sp-then-fp8"])
def test_fp8_attention_sits_inside_the_sp_wrapper_in_either_order(order):
    from ltx_mgpu.parallel.sp.attention import All2AllAttention, AttentionManager
    from ltx_mgpu.parallel.sp.builder import patch_sp_attention

    model = _Model()
    manager = AttentionManager(64, 4, 16, torch.float32, local=True)
    steps = [lambda m: fa.install_fp8_attention(m, only_converted=False), lambda m: patch_sp_attention(m, manager)]
    for step in steps if order == "fp8-then-sp" else steps[::-1]:
        step(model)
    fa.install_fp8_attention(model, only_converted=False)  # idempotent
    for block in model.transformer_blocks:
        fn = block.attn1.attention_function
        assert isinstance(fn, All2AllAttention) and isinstance(fn.inner, fa.Fp8SelfAttention)
        assert fn.inner.q_norm is block.attn1.q_norm and not isinstance(fn.inner.fallback, fa.Fp8SelfAttention)
    assert fa.fp8_attention_count(model) == 2
    x = torch.randn(1, 24, 64)
    with torch.no_grad():
        out = model.transformer_blocks[0].attn1(x)
        attn = model.transformer_blocks[0].attn1
        direct = fa.Fp8SelfAttention(None, attn.q_norm, attn.k_norm, "emulate")
        q, k = attn.q_norm(attn.to_q(x)), attn.k_norm(attn.to_k(x))
        want = attn.to_out(direct(q, k, attn.to_v(x), 4))
    assert torch.equal(out, want)


def test_the_recipes_bf16_blocks_keep_bf16_attention():
    model = fa.install_fp8_attention(_Model(2))  # block 0 is in ltx-core's exclusion list, block 1 is not
    assert not isinstance(model.transformer_blocks[0].attn1.attention_function, fa.Fp8SelfAttention)
    assert isinstance(model.transformer_blocks[1].attn1.attention_function, fa.Fp8SelfAttention)


# ---- the setting -----------------------------------------------------------------------------------------------
def test_quantization_names_and_the_benches_accept_them():
    from bench import stages
    from bench.e2e import runs as e2e
    from ltx_mgpu.runners.ltx2 import components as comp

    assert "fp8-mm+attn" in comp.QUANTIZATIONS
    assert e2e.QUANTIZATIONS == stages.QUANTIZATIONS == comp.QUANTIZATIONS
    assert e2e.parse_args(["--quantization", "fp8-mm+attn"]).quantization == "fp8-mm+attn"
    with pytest.raises(SystemExit):
        e2e.parse_args(["--quantization", "fp8-attn"])
    with pytest.raises(ValueError, match="unknown quantization"):
        comp.quantization_policy("fp8-attn")


def test_setup_fails_clearly_where_the_fp8_attention_cannot_run(monkeypatch):
    from ltx_mgpu.runners.ltx2 import components as comp

    assert "needs a CUDA device" in fa.fp8_attention_support(torch.device("cpu"), "cudnn")
    assert fa.fp8_attention_support(torch.device("cpu")) is None  # the emulation
    assert "unknown FP8 attention backend" in fa.fp8_attention_support(torch.device("cpu"), "flash")
    model = fa.install_fp8_attention(_Model(2))
    from ltx_mgpu.fp8 import Fp8Linear

    model.lin = Fp8Linear(16, 16, device="meta")
    monkeypatch.setattr(type(model), "parameters", lambda self, recurse=True: iter([torch.empty(0, device="meta")]))
    import ltx_mgpu.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(fa, "fp8_attention_support", lambda device: "no cudnn here: pip install it")
    with pytest.raises(ValueError, match="fp8-mm\\+attn.*no cudnn here"):
        comp.check_quantized(model, "fp8-mm+attn")
    with pytest.raises(RuntimeError, match="no attention computes in fp8"):
        comp.check_quantized(_with_fp8_linear(), "fp8-mm+attn")  # (parameters() still reports meta)


def _with_fp8_linear() -> torch.nn.Module:
    from ltx_mgpu.fp8 import Fp8Linear

    model = _Model(1)
    model.lin = Fp8Linear(16, 16)
    return model


# ---- the tiny model ----------------------------------------------------------------------------------------
@pytest.mark.numerics
def test_tiny_transformer_with_fp8_mm_attn_stays_within_the_derived_branch_error():
    """The tiny checkpoint loaded with "fp8-mm+attn" (block 1 converted, block 0 bf16, as the recipe says),
    in fp32 elsewhere: block 1's video update differs from the unquantized one by at most its self-attention
    branch's error: two quantized linears in series (sqrt(2) * 0.051) and the attention's five roundings of
    gain <= 1 (sqrt(5) rho), in quadrature."""
    import copy

    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    from bench.block import block_inputs
    from ltx_mgpu.fp8 import convert_linears
    from ltx_mgpu.runners.ltx2 import components as comp
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    checkpoint = str(ensure_tiny_ltx2().checkpoint)
    loaded = comp.transformer_builder(checkpoint, quantization=comp.quantization_policy("fp8-mm+attn"))
    loaded = loaded.build(device=torch.device("cpu"), dtype=None).eval()
    comp.check_quantized(loaded, "fp8-mm+attn")  # the setting installs it where the recipe converts
    assert fa.fp8_attention_count(loaded) == 1
    assert isinstance(loaded.transformer_blocks[1].attn1.attention_function, fa.Fp8SelfAttention)
    tb = comp.transformer_builder(checkpoint)
    ref = tb.build(device=torch.device("cpu"), dtype=torch.float32).eval()  # fp32: the difference is fp8's
    fp8 = fa.install_fp8_attention(convert_linears(copy.deepcopy(ref), quantize=True))
    vargs, aargs, _, _ = block_inputs(ref, tb.model_config(), 1536, torch.device("cpu"), torch.float32)
    pert = BatchedPerturbationConfig.empty(1)
    with torch.inference_mode():
        rv, _ = ref.transformer_blocks[1](vargs, aargs, pert)
        qv, _ = fp8.transformer_blocks[1](vargs, aargs, pert)
    err = ((qv.x - rv.x).norm() / (rv.x - vargs.x).norm()).item()
    bound = math.sqrt(2 * (2**0.5 * 2.0**-4 / 3**0.5) ** 2 + 5 * RHO2)
    assert 2.0**-8 < err <= bound, (err, bound)
