"""SageAttention 1.0.6 (`sageattention`, pure Triton) as the comparison candidate of the FP8 attention: 8-bit
but not FP8 (Q and K in INT8 with one scale per block of tokens, P.V in fp16), bf16 in and out, so it needs
none of `attention.py`'s scales. `Fp8SelfAttention(backend="sage")` and bench/attention.py call it.

Its `smooth_k` subtracts K's mean over the tokens in place (softmax is unchanged: it shifts every score of
a query by the same amount); ltx-core's k must stay intact (an SP exchange buffer may alias it), so the mean
is subtracted here out of place and the library is told not to.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sage_attention", "sage_support"]

INSTALL_HINT = "pip install sageattention==1.0.6 (20 KB, pure Triton)"


def _sage() -> Any:
    try:
        from sageattention.core import sageattn
    except ImportError as exc:
        raise RuntimeError(f"the sage attention backend needs SageAttention: {INSTALL_HINT} ({exc})") from exc
    return sageattn


def sage_support() -> str | None:
    try:
        _sage()
    except RuntimeError as exc:
        return str(exc)
    return None


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Attention over q (B, T_q, H*D), k/v (B, T_kv, H*D) -> (B, T_q, H*D), in q's dtype."""
    sageattn = _sage()
    b, tq, hidden = q.shape
    d = hidden // heads
    q4, k4, v4 = (x.reshape(b, -1, heads, d) for x in (q, k, v))
    k4 = k4 - k4.mean(dim=1, keepdim=True)
    out = sageattn(q4, k4, v4, tensor_layout="NHD", is_causal=False, smooth_k=False)
    return out.reshape(b, tq, hidden)
