"""Measures where the FP8 attention's error comes from, on one ltx-core block's own q, k and v (19B widths,
bench/block.py's seeded weights): the relative error against fp32 attention of each e4m3 rounding alone (q and
k, v, the softmax P, the output O), all of them (the kernel's emulation), and all of them with v's mean over the
tokens taken out first (`Fp8SelfAttention`'s default). A few heads and up to 1,024 queries per token count keep
it on a CPU.

    python -m bench.fp8_attn_error --tokens 1536,6144          # CPU, ~2 min
    python -m bench.fp8_attn_error --device cuda:0 --tokens 1536,6144,24576
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.block import DIMS, BlockCase
from bench.common import emit
from ltx_mgpu.fp8 import attention as fa


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a - b).norm() / b.norm()), 5)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, round_p: bool, o_scale: float | None) -> torch.Tensor:
    """`emulate_fp8_attention` over already dequantized fp32 (B, H, T, D) inputs (unit scales, v on the output's
    grid: `o_scale` is a power of two, so the division is exact), with only the asked-for roundings: P's, and the
    output's on the grid of `o_scale`."""
    scale = 1.0 if o_scale is None else o_scale
    scales = torch.tensor([1.0, 1.0, scale])
    return fa.emulate_fp8_attention(q, k, v / scale, scales, quantize_p=round_p, quantize_o=o_scale is not None)


def decompose(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, attn: torch.nn.Module, pick: list[int], queries: int
) -> dict[str, float]:
    """The error of each rounding for (B, T, H*D) q, k, v of `attn` (an ltx-core Attention), on heads `pick`."""
    b, _, hidden = q.shape
    d = hidden // heads

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(b, -1, heads, d).transpose(1, 2)[:, pick].float()

    bound = [fa.qk_bound(n, hidden, q.device) for n in (attn.q_norm, attn.k_norm)]
    scales, inv = fa.attention_scales(q, k, v, *bound)
    sq, sk, sv = (float(x) for x in scales)
    q8, k8, v8 = (fa.quantize(x, inv[i]) for i, x in enumerate((q, k, v)))
    qf, kf, vf = split(q)[..., :queries, :], split(k), split(v)
    qd, kd, vd = split(q8)[..., :queries, :] * sq, split(k8) * sk, split(v8) * sv
    ref = _attention(qf, kf, vf, False, None)
    row = {
        "err_q_k": _rel(_attention(qd, kd, vf, False, None), ref),
        "err_v": _rel(_attention(qf, kf, vd, False, None), ref),
        "err_p": _rel(_attention(qf, kf, vf, True, None), ref),
        "err_o": _rel(_attention(qf, kf, vf, False, sv), ref),
        "err_all": _rel(_attention(qd, kd, vd, True, sv), ref),
    }
    shift = fa.value_shift(v)
    vs = v - shift  # (as `Fp8SelfAttention` does: scale, cast, attention on the shifted v, the shift back)
    shifted_scales, shifted_inv = fa.attention_scales(q, k, vs, *bound)
    s_scale = float(shifted_scales[2])
    vsd = split(fa.quantize(vs, shifted_inv[2])) * s_scale
    row["err_all_shifted"] = _rel(_attention(qd, kd, vsd, True, s_scale) + split(shift), ref)
    row["output_mean_share"] = round(float(split(shift).expand_as(ref).norm() / ref.norm()), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dims", choices=sorted(DIMS), default="19b")
    ap.add_argument("--tokens", default="1536,6144")
    ap.add_argument("--heads", default="0,7,19", help="which heads to measure")
    ap.add_argument("--queries", type=int, default=1024)
    args = ap.parse_args(argv)
    case = BlockCase("ltx", DIMS[args.dims], torch.device(args.device))
    attn = case.bf16.attn1
    seen: dict[str, tuple] = {}
    inner = attn.attention_function

    def record(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        seen["qkv"] = (q, k, v, heads)
        return inner(q, k, v, heads, mask)

    attn.attention_function = record
    pick = [int(h) for h in args.heads.split(",")]
    summary = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        vargs, aargs, pert = case.ltx_args(tokens)
        with torch.no_grad():
            case.bf16(vargs, aargs, pert)
            q, k, v, heads = seen.pop("qkv")
            row = {
                "kind": "fp8_attention_error",
                "video_tokens": tokens,
                **decompose(q, k, v, heads, attn, pick, args.queries),
            }
        emit(row)
        summary.append(
            f"{tokens}: {row['err_all']} -> {row['err_all_shifted']} shifted (output rounding {row['err_o']})"
        )
    print("SUMMARY fp8 attention error vs fp32, the block's q/k/v | " + " | ".join(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
