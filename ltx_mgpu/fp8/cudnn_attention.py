"""cuDNN's FP8 scaled-dot-product attention (forward, inference) through `nvidia-cudnn-frontend`'s Python
graph API, for `attention.Fp8SelfAttention`.

Why cuDNN: at LTX-2's shapes (32 heads x 128, 1,536 to 47,616 tokens, no mask) it is the one FP8 attention
for Hopper in a package that installs without a build (a 12 MB wheel whose `cudnn` module loads the cuDNN 9
runtime torch already ships) and is kept by NVIDIA; bench/attention.py measures it against torch's bf16
backends and SageAttention (docs/performance.md).

The graph (q, k, v e4m3 in ltx-core's (B, T, H, D) layout, six fp32 scale tensors, O e4m3 in the same
layout: Hopper's FP8 SDPA writes FP8 only; bf16 output needs Blackwell) is built once per (device, B, H,
T_q, T_kv, D) on its first call and kept for the life of the process, so a fleet never rebuilds one after
its first forward of a shape. A first call should be eager (the runners' CUDA-graph wrapper captures a shape
after running it eagerly); later calls allocate only the output and the workspace, through torch's caching
allocator (the graph pool under capture), launch on torch's current stream and never synchronise the host,
so they can be captured (tests/test_fp8_attention_gpu.py replays one).

`cudnn` is imported on first use; without it, `cudnn_fp8_support` says how to install it and a call raises.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

__all__ = ["cudnn_fp8_sdpa", "cudnn_fp8_support"]

INSTALL_HINT = "pip install nvidia-cudnn-frontend (a 12 MB wheel; it uses the cuDNN 9 that torch ships)"
P_SCALE = 256.0  #: attention.P_SCALE (the softmax probabilities' e4m3 scale)

_lock = threading.Lock()
_graphs: dict[tuple[Any, ...], _Graph] = {}
_handles: dict[int, Any] = {}


def _cudnn() -> Any:
    try:
        import cudnn
    except ImportError as exc:
        raise RuntimeError(f"FP8 attention needs cuDNN's Python frontend: {INSTALL_HINT} ({exc})") from exc
    return cudnn


def cudnn_fp8_support(device: torch.device) -> str | None:
    """None when cuDNN's FP8 SDPA can run on `device`, else the reason (library, GPU or cuDNN too old)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cuDNN FP8 attention needs a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"cuDNN FP8 attention needs Hopper or newer (sm_90+); {name} is not: use quantization 'fp8-mm'"
    try:
        cudnn = _cudnn()
    except RuntimeError as exc:
        return str(exc)
    version = int(cudnn.backend_version())
    if version < 90100 or version == 91000:  # the frontend's own FP8 SDPA gates
        return f"cuDNN {version} has no usable FP8 SDPA (needs 9.1 or newer, not 9.10.0)"
    return None


def _handle(cudnn: Any, device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _handles.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _handles[index] = cudnn.create_handle()
    return handle


class _Graph:
    """One built FP8 SDPA graph and its tensor descriptors."""

    def __init__(self, cudnn: Any, handle: Any, b: int, h: int, tq: int, tk: int, d: int) -> None:
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def layout(t: int) -> dict[str, Any]:  # (B, T, H, D) memory seen as (B, H, T, D)
            return {"dim": [b, h, t, d], "stride": [t * h * d, d, h * d, 1], "data_type": e4m3}

        self.q = graph.tensor(name="q", **layout(tq))
        self.k = graph.tensor(name="k", **layout(tk))
        self.v = graph.tensor(name="v", **layout(tk))
        one = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": f32}
        self.scales = [
            graph.tensor(name=n, **one)
            for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        ]
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=self.q,
            k=self.k,
            v=self.v,
            descale_q=self.scales[0],
            descale_k=self.scales[1],
            descale_v=self.scales[2],
            descale_s=self.scales[3],
            scale_s=self.scales[4],
            scale_o=self.scales[5],
            is_inference=True,
            attn_scale=1.0 / math.sqrt(d),
            use_causal_mask=False,
            name="ltx_fp8_sdpa",
        )
        o.set_output(True).set_dim(layout(tq)["dim"]).set_stride(layout(tq)["stride"]).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.amax_s, self.amax_o = o, amax_s, amax_o
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_bytes = int(graph.get_workspace_size())


def _graph_for(cudnn: Any, device: torch.device, b: int, h: int, tq: int, tk: int, d: int) -> _Graph:
    key = (device.index, b, h, tq, tk, d)
    g = _graphs.get(key)
    if g is None:
        with _lock:
            g = _graphs.get(key)
            if g is None:
                g = _graphs[key] = _Graph(cudnn, _handle(cudnn, device), b, h, tq, tk, d)
    return g


def cudnn_fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over e4m3 `q8` (B, T_q, H, D), `k8`/`v8` (B, T_kv, H, D) with
    dequantization `scales` (3,) fp32 for (q, k, v) on the device; returns O (B, T_q, H, D) e4m3 on v's grid
    (O = result * scales[2]). Non-contiguous inputs are copied."""
    cudnn = _cudnn()
    q8, k8, v8 = (x if x.is_contiguous() else x.contiguous() for x in (q8, k8, v8))
    b, tq, h, d = q8.shape
    tk = k8.shape[1]
    device = q8.device
    g = _graph_for(cudnn, device, b, h, tq, tk, d)
    scales = scales.to(torch.float32)
    inv_v = 1.0 / scales[2:3]  # a power of two: exact
    consts = torch.full((2,), P_SCALE, dtype=torch.float32, device=device)
    consts[0:1].reciprocal_()  # (1/256, 256): a fill and an exact reciprocal, no host-to-device copy
    o8 = torch.empty((b, tq, h, d), dtype=torch.float8_e4m3fn, device=device)
    amax = torch.empty((2,), dtype=torch.float32, device=device)
    workspace = torch.empty((max(g.workspace_bytes, 1),), dtype=torch.uint8, device=device)
    one = (1, 1, 1, 1)
    pack = {
        g.q: q8.transpose(1, 2),
        g.k: k8.transpose(1, 2),
        g.v: v8.transpose(1, 2),
        g.o: o8.transpose(1, 2),
        g.scales[0]: scales[0:1].view(one),
        g.scales[1]: scales[1:2].view(one),
        g.scales[2]: scales[2:3].view(one),
        g.scales[3]: consts[0:1].view(one),
        g.scales[4]: consts[1:2].view(one),
        g.scales[5]: inv_v.view(one),
        g.amax_s: amax[0:1].view(one),
        g.amax_o: amax[1:2].view(one),
    }
    handle = _handle(cudnn, device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    g.graph.execute(pack, workspace, handle=handle)
    return o8
