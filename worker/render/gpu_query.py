"""What a group's GPUs are, read without creating a CUDA context (the fleet's ranks make theirs later): NVML
where `pynvml` is installed and answers, else `nvidia-smi`. Names, memory (total and free) and compute
capability, one row per asked index, or None when neither source answers for every index."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["capabilities", "memory", "nvml_rows", "smi_rows"]

Row = TypeVar("Row")


def _name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def nvml_rows(indices: list[int], read: Callable[[Any, Any], Row]) -> list[Row] | None:
    """`read(pynvml, handle)` for each index, in order; None where NVML is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return [read(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def smi_rows(indices: list[int], fields: str, parse: Callable[[list[str]], Row | None]) -> list[Row] | None:
    """`nvidia-smi --query-gpu=index,<fields>` parsed by `parse(values after the index)` (None: a row it cannot
    read), for each index in order; None where nvidia-smi is missing, fails or lacks one of them."""
    query = ["nvidia-smi", f"--query-gpu=index,{fields}", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows: dict[int, Row] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        row = parse(parts[1:]) if parts and parts[0].isdigit() else None
        if row is not None:
            rows[int(parts[0])] = row
    return [rows[i] for i in indices] if all(i in rows for i in indices) else None


def _smi_memory(values: list[str]) -> tuple[str, int, int] | None:
    if len(values) != 3:
        return None
    return values[0], int(float(values[1])) << 20, int(float(values[2])) << 20


def _smi_capability(values: list[str]) -> tuple[str, tuple[int, int]] | None:
    major, _, minor = values[1].partition(".") if len(values) == 2 else ("", "", "")
    if not (major.isdigit() and minor.isdigit()):
        return None  # (a driver too old for `compute_cap` says "[N/A]" or refuses the field)
    return values[0], (int(major), int(minor))


def memory(indices: list[int]) -> list[tuple[str, int, int]] | None:
    """(name, total bytes, free bytes) per index."""

    def read(nvml: Any, handle: Any) -> tuple[str, int, int]:
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        return _name(nvml.nvmlDeviceGetName(handle)), int(mem.total), int(mem.free)

    return nvml_rows(indices, read) or smi_rows(indices, "name,memory.total,memory.free", _smi_memory)


def capabilities(indices: list[int]) -> list[tuple[str, tuple[int, int]]] | None:
    """(name, (major, minor) compute capability) per index."""

    def read(nvml: Any, handle: Any) -> tuple[str, tuple[int, int]]:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return _name(nvml.nvmlDeviceGetName(handle)), (int(major), int(minor))

    return nvml_rows(indices, read) or smi_rows(indices, "name,compute_cap", _smi_capability)
