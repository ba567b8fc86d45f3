"""Tiled stage 2 on a GPU (skipped without CUDA): after the first step of a stage, a step of the TDP wrapper
never synchronises with the host (`torch.cuda.set_sync_debug_mode("error")` around it) and copies no index
or mask to the device, with and without conditioning tokens; its outputs are the bits of a fresh wrapper.
The tiny LTX-2 transformer's own eager forward is sync-free (tests/test_graphs_gpu.py), so a sync here is
the wrapper's.

Run on a GPU host:  pytest -m gpu tests/test_tdp_gpu.py -v
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ltx_mgpu.parallel.pipeline.tdp import TiledDataParallelModelWrapper

from .test_tdp import TILING_2x2, inputs, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to(modality, device):
    moved = {f.name: getattr(modality, f.name) for f in dataclasses.fields(modality)}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    return dataclasses.replace(modality, **moved)


@pytest.mark.parametrize("keyframe", [False, True])
def test_steps_after_the_first_make_no_host_sync(keyframe):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig

    device = torch.device("cuda", torch.cuda.current_device())
    model = tiny_model().to(device)
    shape, video, audio = inputs(0.3, keyframe=keyframe)
    video, audio = _to(video, device), _to(audio, device)
    none = BatchedPerturbationConfig.empty(1)
    wrapper = TiledDataParallelModelWrapper(model, tiling=TILING_2x2)
    wrapper.set_latent_shape(shape)
    with torch.no_grad():
        first = wrapper(video, audio, none)  # plans the stage (one device->host read with keyframes)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            later = [wrapper(video, audio, none) for _ in range(2)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fresh = TiledDataParallelModelWrapper(model, tiling=TILING_2x2)
        fresh.set_latent_shape(shape)
        ref = fresh(video, audio, none)
    for out in (first, *later):
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
