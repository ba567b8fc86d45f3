"""Perturbation masks under CUDA-graph capture: the eager forward before a capture makes them, the capture
reads those (ltx-core's own construction writes per-row scalars into a device tensor: a host->device copy
that capture refuses, seen on the H200 as "Cannot copy between CPU and CUDA tensors during CUDA graph
capture"), and a mask a graph reads is never evicted."""

from __future__ import annotations

import torch

from ltx_mgpu.parallel.graphs.capture_cache import capture_scope
from ltx_mgpu.parallel.graphs.hoist import ForwardHoister


def _batched(*blocks: int) -> object:
    from ltx_core.guidance.perturbations import (
        BatchedPerturbationConfig,
        Perturbation,
        PerturbationConfig,
        PerturbationType,
    )

    rows = [PerturbationConfig.empty()] + [
        PerturbationConfig([Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [b])]) for b in blocks
    ]
    return BatchedPerturbationConfig(rows)


def test_capture_reads_the_eager_masks_and_builds_none(monkeypatch) -> None:
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig, PerturbationType

    hoister = ForwardHoister(torch.nn.Module())
    kind = PerturbationType.SKIP_VIDEO_SELF_ATTN
    eager = hoister.perturbations(_batched(1))
    mask = eager.mask(kind, 1, "cpu", torch.float32)
    assert mask.tolist() == [1.0, 0.0]

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a mask was built during capture")

    monkeypatch.setattr(BatchedPerturbationConfig, "mask", refuse)
    with capture_scope():
        captured = hoister.perturbations(_batched(1))  # a new object with the same configuration
        assert captured is eager
        assert captured.mask(kind, 1, "cpu", torch.float32) is mask


def test_capture_without_an_eager_forward_takes_ltx_cores_path() -> None:
    hoister = ForwardHoister(torch.nn.Module())
    batched = _batched(3)
    with capture_scope():
        assert hoister.perturbations(batched) is batched


def test_masks_a_graph_reads_are_never_evicted() -> None:
    from ltx_core.guidance.perturbations import PerturbationType

    hoister = ForwardHoister(torch.nn.Module())
    kind = PerturbationType.SKIP_VIDEO_SELF_ATTN
    first = hoister.perturbations(_batched(0))
    mask = first.mask(kind, 0, "cpu", torch.float32)
    with capture_scope():
        assert hoister.perturbations(_batched(0)) is first
    for block in range(1, hoister.perturbation_capacity + 4):  # push the LRU well past its capacity
        hoister.perturbations(_batched(block))
    with capture_scope():
        again = hoister.perturbations(_batched(0))
    assert again is first and again.mask(kind, 0, "cpu", torch.float32) is mask
