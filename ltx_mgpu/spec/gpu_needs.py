"""What a transformer quantization needs of the GPU, as one table read twice: by the worker before a fleet loads
(the group's compute capability from NVML or `nvidia-smi`, no CUDA context: a configuration error, exit 2,
so a fleet that could never run is not built, failed and rebuilt in a loop) and by every rank before its
transformer loads (`torch.cuda.get_device_capability`, for a controller used without the worker).

`fp8-mm` runs its GEMMs on FP8 tensor cores (`torch._scaled_mm`: compute capability 8.9, Ada, and later; on an
A100, 8.0, the only path left is the emulation, which dequantizes every weight per call in fp32);
`fp8-mm+attn` adds cuDNN's FP8 attention, Hopper (9.0) and later. `fp8-cast` stores the weights in fp8 and
computes in bf16: any GPU. Stdlib only (the worker imports it before torch is needed).
"""

from __future__ import annotations

__all__ = ["MIN_CAPABILITY", "capability_problem"]

#: the least compute capability each quantization runs at; one not listed runs on any GPU
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"fp8-mm": (8, 9), "fp8-mm+attn": (9, 0)}
_WHY = {
    "fp8-mm": "FP8 tensor cores (Ada, Hopper and later)",
    "fp8-mm+attn": "cuDNN's FP8 attention (Hopper and later)",
}
_INSTEAD = {
    "fp8-mm": "leave quantization unset (bf16) or use 'fp8-cast' (fp8 weights, bf16 compute)",
    "fp8-mm+attn": "use quantization 'fp8-mm' (FP8 GEMMs, bf16 attention)",
}


def capability_problem(quantization: str | None, capability: tuple[int, int], device_name: str) -> str | None:
    """Why `quantization` cannot run on a GPU of `capability` (major, minor) named `device_name`, in one line
    that says what would; None when it can (or when no quantization, or one any GPU runs, is asked for)."""
    need = MIN_CAPABILITY.get(quantization or "")
    if need is None or tuple(capability) >= need:
        return None
    return (
        f"quantization {quantization!r} needs {_WHY[quantization]}, compute capability {need[0]}.{need[1]} or "
        f"later; {device_name} is {capability[0]}.{capability[1]}: {_INSTEAD[quantization]}"
    )
