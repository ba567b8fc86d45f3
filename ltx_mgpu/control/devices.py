"""Device maps for a fleet: parsing group specs and choosing the process-group backend.

A fleet is a list of devices, one per rank: `"cpu"` or `"cuda:N"`. Rank r binds to `devices[r]` with
`torch.cuda.set_device`, never through `CUDA_VISIBLE_DEVICES` (the spawn bootstrap may already have
touched CUDA, freezing the device list) and never by assuming device index == rank, so two fleets can
share one machine on disjoint GPUs (`[0, 1, 2, 3]` and `[4, 5, 6, 7]`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "ALLOCATOR_ENV",
    "MULTICAST_OFF_ENV",
    "DeviceLike",
    "canonical_group",
    "choose_backend",
    "normalize_devices",
    "parse_device_group",
]

DeviceLike = int | str  # 3, "cuda:3", "cpu"; torch.device also works (its str() is parsed)

#: Set (unless already set) in every rank process before its process group exists. NVLink multicast
#: (NVLS) in NCCL, PyTorch symmetric memory and NVSHMEM is a hazard on shared multi-GPU hosts (a program
#: using it can take the host's GPUs out of service) and buys nothing here: the head exchange is an
#: all-to-all (our kernel or NCCL's), not an all-reduce.
MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


#: Set (unless already set) in every rank process before it allocates on its GPU. Expandable segments let the
#: caching allocator grow and shrink a segment instead of keeping a freed block of one size for reuse: at
#: 1920x1088x241 on one H200 the reserved peak of the decode fell from 124.8 to 101.5 GiB for the same allocated
#: 81.8 (docs/memory.md), and the text encoder's pinned mirror can leave and come back as one allocation.
ALLOCATOR_ENV: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


_CPU_GROUP = re.compile(r"^cpu(?::(\d+))?$")


def parse_device_group(spec: str) -> list[str]:
    """Parse a command-line group into one device per rank.

    "0,1,2,3" or "cuda:0,cuda:1" (CUDA devices, each once), "cpu" (one CPU rank), "cpu:2" (two CPU ranks).
    Spaces are ignored. Anything else ("cpu2", "cpu:0", "0,0", "0,cpu") is a `ValueError` naming the
    group. The one parser for groups: the worker's settings validate with it (`canonical_group`) and the
    fleet is built from it, so a group that passes validation is the group that runs.
    """
    text = spec.replace(" ", "")
    if not text:
        raise ValueError("empty device group: expected 'cpu', 'cpu:N' or comma-separated GPU indices")
    if text.startswith("cpu"):
        match = _CPU_GROUP.match(text)
        if match is None:
            raise ValueError(f"group {spec!r}: expected 'cpu' or 'cpu:N' (N >= 1 CPU ranks)")
        n = int(match.group(1)) if match.group(1) is not None else 1
        if n < 1:
            raise ValueError(f"group {spec!r}: need at least one CPU rank")
        return ["cpu"] * n
    try:
        devices = normalize_devices(text.split(","), allow_shared=True)
    except ValueError as exc:
        raise ValueError(f"group {spec!r}: {exc}") from None
    if len(set(devices)) != len(devices):
        raise ValueError(f"group {spec!r}: a GPU appears twice")
    return devices


def canonical_group(spec: str) -> str:
    """The canonical spelling of a group: "cpu", "cpu:N" or "i,j,..." (CUDA indices); `ValueError` if bad."""
    devices = parse_device_group(spec)
    if devices[0] == "cpu":
        return "cpu" if spec.replace(" ", "") == "cpu" else f"cpu:{len(devices)}"
    return ",".join(d.removeprefix("cuda:") for d in devices)


def _normalize_one(device: object) -> str:
    if isinstance(device, bool):
        raise ValueError(f"not a device: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"CUDA device index must be >= 0, got {device}")
        return f"cuda:{device}"
    text = str(device).strip()
    if text == "cpu":
        return "cpu"
    if text.isdigit():
        return f"cuda:{int(text)}"
    if text.startswith("cuda:") and text[5:].isdigit():
        return f"cuda:{int(text[5:])}"
    raise ValueError(f"not a device: {device!r} (use an index, 'cuda:N' or 'cpu')")


def normalize_devices(devices: Sequence[object], *, allow_shared: bool) -> list[str]:
    """Canonical per-rank device strings. CUDA devices must be unique unless `allow_shared`."""
    if isinstance(devices, str | bytes) or not devices:
        raise ValueError(f"devices must be non-empty and unique: {list(devices) if devices else []}.")
    out = [_normalize_one(d) for d in devices]
    kinds = {d == "cpu" for d in out}
    if len(kinds) > 1:
        raise ValueError(f"devices must be all CPU or all CUDA, got {out}")
    cuda = [d for d in out if d != "cpu"]
    if len(set(cuda)) != len(cuda) and not allow_shared:
        raise ValueError(
            f"devices must be non-empty and unique: {out}. To run several ranks on one GPU (gloo; for "
            "testing multi-rank code on a single GPU) pass allow_shared_devices=True."
        )
    return out


def choose_backend(devices: Sequence[str]) -> str:
    """NCCL when every rank owns a distinct GPU; gloo for CPU ranks and for ranks sharing a GPU
    (NCCL refuses two ranks on one device: "Duplicate GPU detected")."""
    if all(d.startswith("cuda:") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"
