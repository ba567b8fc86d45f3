"""The denoising step is graph-ready: no host sync, no host->device copy, no data-dependent shape and no
CPU tensor in the transformer forward as the SP wrapper drives it, nor in a guidance-parallel step.

Method (`ltx_mgpu.parallel.graphs.graph_audit.HostSyncAudit`): weights and inputs on the `meta` device, a
`TorchDispatchMode` records every op that would involve the host on a GPU. Multi-rank forwards run in a
fresh process under torch.distributed's "fake" backend (collectives complete without data), which audits
any rank of any world size in one process.

- positive control: ltx-core's own forward is caught (the RoPE grid copied from the CPU, the mask's
  `positive.any()` sync and boolean indexing), so an empty audit below means something;
- the hoisted SP forward, at worlds 1, 2, 3 (padding, a user mask, STG and modality perturbations): the
  first forward may build device-resident caches; every later forward has no event, and neither has a
  forward under `capture_scope()` (caches bypassed: what a CUDA-graph capture runs);
- a whole guided step (4 passes, ltx-core's guider) under every layout of worlds 2 and 4, gather included;
- the hoisting shows as fewer dispatched ops per forward than with ltx-core's own preparation.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from typing import Any

import pytest
import torch

from ltx_mgpu.parallel.graphs.graph_audit import HostSyncAudit
from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

HEADS = 12
BATCH = 2


def _model() -> tuple[torch.nn.Module, dict[str, Any]]:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS)
    with torch.device("meta"):
        model = LTXModelConfigurator.from_config(cfg)
    return model.eval(), cfg["transformer"]


def _inputs(t: dict[str, Any], tokens: int = 13, audio_tokens: int = 5, mask: bool = True) -> tuple:
    from ltx_core.guidance.perturbations import (
        BatchedPerturbationConfig,
        Perturbation,
        PerturbationConfig,
        PerturbationType,
    )
    from ltx_core.model.transformer.modality import Modality

    def modality(n: int, channels: int, dims: int, attention_mask: torch.Tensor | None) -> Modality:
        return Modality(
            latent=torch.empty(BATCH, n, channels, device="meta"),
            sigma=torch.empty(BATCH, device="meta"),
            timesteps=torch.empty(BATCH, n, 1, device="meta"),
            positions=torch.empty(1, dims, n, 2, device="meta").expand(BATCH, dims, n, 2),
            context=torch.empty(BATCH, 5, t["caption_channels"], device="meta"),
            context_mask=None,
            attention_mask=attention_mask,
        )

    user_mask = torch.empty(BATCH, tokens, tokens, device="meta") if mask else None
    video = modality(tokens, t["in_channels"], 3, user_mask)
    audio = modality(audio_tokens, t["audio_in_channels"], 1, None)
    perturbations = BatchedPerturbationConfig(
        [
            PerturbationConfig.empty(),
            PerturbationConfig(
                [
                    Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1]),
                    Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None),
                    Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None),
                ]
            ),
        ]
    )
    return video, audio, perturbations


def _audit(fn: Any, *args: Any) -> HostSyncAudit:
    audit = HostSyncAudit()
    with audit.meta_data_dependent(), torch.no_grad():
        fn(*args)
    return audit


# =========================================================================================================
# Run in a fresh process (a fake default process group must not leak into the test process)
# =========================================================================================================


def _init_fake(world: int, rank: int) -> None:
    if world > 1:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _sp_forward_events(world: int, rank: int) -> dict[str, Any]:
    from ltx_core.model.transformer import X0Model

    from ltx_mgpu.parallel import AttentionManager, SequenceParallelModelWrapper, patch_sp_attention
    from ltx_mgpu.parallel.graphs.capture_cache import capture_scope

    _init_fake(world, rank)
    out: dict[str, Any] = {}
    for hoist in (True, False):
        model, t = _model()
        mgr = AttentionManager(4096, HEADS, 8, torch.float32, None, backend="dist", device="meta", local=world == 1)
        patch_sp_attention(model, mgr)
        x0 = X0Model(SequenceParallelModelWrapper(model, mgr, hoist=hoist))
        video, audio, perturbations = _inputs(t)
        first = _audit(x0, video, audio, perturbations)
        # a later step: new Modality and perturbation objects around the same tensors, as run_passes builds
        steady = _audit(
            x0, dataclass_copy(video), dataclass_copy(audio), type(perturbations)(perturbations.perturbations)
        )
        name = "hoisted" if hoist else "plain"
        out[name] = {"first": first.report(), "steady": [str(e) for e in steady.events], "ops": steady.count_ops}
        if hoist:
            with capture_scope():
                captured = _audit(x0, video, audio, perturbations)
            out["capture"] = [str(e) for e in captured.events]
    return out


def dataclass_copy(modality: Any) -> Any:
    """The same tensors in a new Modality object, as a denoising loop builds one per step."""
    import dataclasses

    return dataclasses.replace(modality)


def _guided_step_events(world: int, rank: int) -> dict[str, list[str]]:
    from ltx_core.model.transformer import X0Model

    from ltx_mgpu.parallel import (
        AttentionRouter,
        GuidanceParallelPasses,
        LayoutGroups,
        SequenceParallelModelWrapper,
        patch_sp_attention,
    )
    from ltx_mgpu.runners.ltx2.denoise import GuidanceParams, guided_denoise, run_passes

    _init_fake(world, rank)
    model, t = _model()
    groups = LayoutGroups.build(world, rank, world_group=None)
    router = AttentionRouter.build(groups, 4096, HEADS, 8, torch.float32, backend="dist", device="meta")
    patch_sp_attention(model, router)
    x0 = X0Model(SequenceParallelModelWrapper(model, router))
    video, audio, _ = _inputs(t, mask=False)

    class State:  # what the step reads from a latent state
        def __init__(self, m: Any) -> None:
            self.latent = m.latent[:1]
            self.denoise_mask = torch.empty(1, m.latent.shape[1], 1, device="meta")
            self.positions = m.positions[:1]
            self.attention_mask = None

    vs, aus = State(video), State(audio)
    contexts = (video.context[:1], audio.context[:1])
    sigma = torch.empty((), device="meta")
    out = {}
    for layout in groups.layouts:
        run = GuidanceParallelPasses(groups, router, run_passes, choose=layout, max_tokens=4096, device="meta")
        step = guided_denoise(
            x0,
            4,
            positive=contexts,
            negative=contexts,
            video=GuidanceParams(3.0, 1.0, (1,), 0.7, 3.0),
            audio=GuidanceParams(7.0, 1.0, (1,), 0.7, 3.0),
            run=run,
        )
        _audit(step, vs, aus, sigma)  # first step: caches
        out[str(layout)] = [str(e) for e in _audit(step, vs, aus, sigma).events]
    return out


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=240)


# =========================================================================================================
# Tests
# =========================================================================================================


def test_audit_catches_ltx_core_host_work() -> None:
    model, t = _model()
    audit = _audit(model, *_inputs(t))
    where = {(e.kind, e.where.split(":")[0]) for e in audit.events}
    assert ("host-copy", "ltx_core/model/transformer/rope.py") in where, audit.report()
    assert ("host-sync", "ltx_core/model/transformer/transformer_args.py") in where, audit.report()
    assert ("data-dependent", "ltx_core/model/transformer/transformer_args.py") in where, audit.report()
    # a second forward is no better: ltx-core repeats the copies every call
    again = _audit(model, *_inputs(t))
    assert sum(e.kind == "host-copy" for e in again.events) >= 4, again.report()


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_sp_forward_is_graph_ready(world: int, rank: int) -> None:
    res = _in_fresh_process(_sp_forward_events, world, rank)
    assert res["hoisted"]["steady"] == [], res["hoisted"]["steady"]
    assert res["capture"] == [], res["capture"]
    assert res["plain"]["steady"], "the unhoisted forward should show ltx-core's host work"
    assert res["hoisted"]["ops"] < res["plain"]["ops"], (res["hoisted"]["ops"], res["plain"]["ops"])


@pytest.mark.parametrize(("world", "rank"), [(2, 1), (4, 3)])
def test_guidance_parallel_step_is_graph_ready(world: int, rank: int) -> None:
    res = _in_fresh_process(_guided_step_events, world, rank)
    assert set(res) == {"1x2", "2x1"} if world == 2 else {"1x4", "2x2", "4x1"}
    for layout, events in res.items():
        assert events == [], f"{layout}: {events}"


def test_identity_cache_follows_the_inputs_lifetime_and_versions() -> None:
    import gc

    from ltx_mgpu.parallel.graphs.capture_cache import IdentityCache

    cache = IdentityCache(capacity=4)
    calls = []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    base = torch.arange(12.0).reshape(1, 3, 4)
    assert cache.get((base.expand(2, 3, 4),), "k", compute) == 1
    assert cache.get((base.expand(2, 3, 4),), "k", compute) == 1  # a new view of the same memory: a hit
    base.add_(1)  # in place: the version moved
    assert cache.get((base.expand(2, 3, 4),), "k", compute) == 2
    assert len(cache) == 1  # the new value replaced the stale one (same key)
    del base
    gc.collect()
    assert len(cache) == 0  # the storage died: every entry on it left with it
    with torch.inference_mode():
        frozen = torch.zeros(3)
    cache.get((frozen,), "k", compute)
    cache.get((frozen,), "k", compute)
    assert len(calls) == 4 and len(cache) == 0  # inference tensors have no version: never cached


def test_geometry_keeps_no_caller_tensor_alive() -> None:
    import gc
    import weakref

    from ltx_mgpu.parallel.graphs.hoist import ForwardHoister

    from .test_graphs import _inputs

    model, t = _model()
    model = model.to_empty(device="cpu")
    hoister = ForwardHoister(model)
    video, audio, _ = _inputs(t, 0)
    geo = hoister.geometry("video", video)
    alive = weakref.ref(video.positions._base)
    assert geo.padded_positions is None and len(hoister.geometries) == 1
    del video, audio
    gc.collect()
    assert alive() is None and len(hoister.geometries) == 0
