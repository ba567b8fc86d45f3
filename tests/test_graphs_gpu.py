"""CUDA graphs and guidance parallelism on GPUs (skipped without CUDA; the two-GPU tests need two).

For every layout of the world, a guided stage (4 passes: cond, negative, STG, modality; ltx-core's
guider; several Euler steps) runs twice from the same noise on the tiny LTX-2 transformer: eagerly, and
through `CudaGraphForward` (call 1 eager, call 2 captured, later calls replayed). Checked:
- graph replay == eager, bit for bit, at every step, in fp32 and bf16, for W=1 (one GPU) and W=2 (two
  GPUs over NCCL), with the `dist` backend and, where built, the `ipc` kernel (zero-copy views);
- the graphed run really replayed graphs (no silent fallback), and the eager forwards after the first
  never synchronise with the host (`torch.cuda.set_sync_debug_mode("error")` around them);
- guidance parallel (2x1) and SP (1x2) against the single-GPU stage: fp32 within 1e-4, bf16 within a
  few bf16 ulps of the output scale after 4 steps (the benchmark measures one step at 19B dimensions).

Run on the two-GPU host:  pytest -m gpu tests/test_graphs_gpu.py -v
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from ltx_mgpu.parallel.testing import LocalWorld, WorldContext
from ltx_mgpu.runners.smoke.checkpoint import ensure_smoke_checkpoint, tiny_transformer_config

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NCCL_ENV.items():
    os.environ.setdefault(_key, _value)  # inherited by the spawned ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

HEADS = 12
STEPS = 4
TOKENS = (3, 4, 4)  # 48 video tokens


def _ipc_available() -> bool:
    try:
        from ltx_mgpu.parallel.sp.backends.ipc import is_available
    except ImportError:
        return False
    return torch.cuda.device_count() >= 2 and is_available(torch.device("cuda", 0))


BACKENDS = [
    "dist",
    pytest.param("ipc", marks=pytest.mark.skipif(not _ipc_available(), reason="ipc kernel not built/usable")),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS, num_layers=3)
    return str(ensure_smoke_checkpoint(tmp_path_factory.mktemp("graphs_gpu"), transformer_config=cfg).transformer_path)


class _SyncChecked:
    """The forward with host syncs turned into errors, from its second call on (the first builds caches)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.fn(*args)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _stage(ctx: WorldContext, path: str, backend: str, dtype_name: str) -> dict[str, Any]:
    """Every layout: eager vs graphed stage (bitwise), and each against the plain single-GPU stage."""
    from ltx_core.components.diffusion_steps import EulerDiffusionStep
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.transformer import X0Model
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    from ltx_mgpu.parallel import (
        AttentionRouter,
        CudaGraphForward,
        GuidanceParallelPasses,
        LayoutGroups,
        SequenceParallelBuilder,
    )
    from ltx_mgpu.runners.ltx2.denoise import GuidanceParams, blend_clean, guided_denoise, run_passes
    from ltx_mgpu.runners.smoke.denoise import SmokeGeometry

    dtype = getattr(torch, dtype_name)
    device = ctx.device
    inner = SingleGPUModelBuilder(LTXModelConfigurator, path)
    cfg = inner.model_config()["transformer"]
    groups = LayoutGroups.build(ctx.world_size, ctx.rank, world_group=None)
    router = AttentionRouter.build(
        groups, 4096, HEADS, cfg["attention_head_dim"], dtype, backend=backend, device=device, head_counts=(HEADS,)
    )
    x0_sp = X0Model(SequenceParallelBuilder(inner, router).build(device=device, dtype=dtype))
    x0_ref = X0Model(inner.build(device=device, dtype=dtype).eval())

    f, h, w = TOKENS
    g = torch.Generator().manual_seed(0)
    geo = SmokeGeometry(w * 32, h * 32, (f - 1) * 8 + 1, 24.0, cfg["in_channels"], cfg["audio_in_channels"])
    vs0 = geo.video_tools(1).create_initial_state(device, dtype)
    as0 = geo.audio_tools(1).create_initial_state(device, dtype)
    vs0 = dataclasses.replace(vs0, latent=torch.randn(vs0.latent.shape, generator=g).to(device, dtype))
    as0 = dataclasses.replace(as0, latent=torch.randn(as0.latent.shape, generator=g).to(device, dtype))
    caption = cfg["caption_channels"]
    pos = tuple(torch.randn(1, 5, caption, generator=g).to(device, dtype) for _ in range(2))
    neg = tuple(torch.randn(1, 5, caption, generator=g).to(device, dtype) for _ in range(2))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float32)
    euler = EulerDiffusionStep()

    def run_stage(x0: Any, run: Any) -> list[torch.Tensor]:
        step = guided_denoise(
            x0,
            4,
            positive=pos,
            negative=neg,
            video=GuidanceParams(3.0, 1.0, (1,), 0.7, 3.0),
            audio=GuidanceParams(7.0, 1.0, (1,), 0.7, 3.0),
            run=run,
        )
        vs, aus, out = vs0, as0, []
        for i in range(STEPS):
            dv, da = step(vs, aus, sigmas[i])
            dv, da = blend_clean(dv, vs), blend_clean(da, aus)
            vs = dataclasses.replace(vs, latent=euler.step(vs.latent, dv, sigmas, i))
            aus = dataclasses.replace(aus, latent=euler.step(aus.latent, da, sigmas, i))
            out.append(torch.cat([vs.latent.flatten(), aus.latent.flatten()]).float().cpu())
        return out

    with torch.inference_mode():
        reference = run_stage(x0_ref, run_passes)
        results = {}
        for layout in groups.layouts:
            run = GuidanceParallelPasses(groups, router, run_passes, choose=layout, max_tokens=4096, device=device)
            eager = run_stage(_SyncChecked(x0_sp), run)
            graphed_fn = CudaGraphForward(
                x0_sp,
                key_fn=lambda: router.active_layout,
                capturable=router.capture_blocker,
                agree=router.all_agree,
            )
            graphed = run_stage(graphed_fn, run)
            scale = reference[-1].abs().max().item()
            results[str(layout)] = {
                "bitwise": [torch.equal(a, b) for a, b in zip(eager, graphed, strict=True)],
                "graph_stats": graphed_fn.describe(),
                "last_path": graphed_fn.last_path,
                "max_diff_to_single_gpu": (eager[-1] - reference[-1]).abs().max().item(),
                "final_sum": eager[-1].double().sum().item(),
                "ulp": 2.0 ** (torch.tensor(scale).log2().floor().item() - 7),  # bf16 ulp at the output scale
                "backend": router.manager(layout).backend_name,
            }
    return results


def _check(results: dict[str, Any], dtype: str) -> None:
    for layout, res in results.items():
        label = f"{layout}: {res}"
        assert all(res["bitwise"]), label
        stats = res["graph_stats"]
        assert stats["captured"] >= 1 and stats["replayed"] >= 1 and stats["failed"] == 0, label
        assert res["last_path"] == "graph: replay", label
        if dtype == "float32":
            assert res["max_diff_to_single_gpu"] <= 1e-4, label
        else:
            assert res["max_diff_to_single_gpu"] <= 8 * res["ulp"], label  # 4 steps; batch shapes differ


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_on_one_gpu(checkpoint: str, dtype: str) -> None:
    with LocalWorld(1, devices=["cuda:0"], backend="nccl", timeout=600) as world:
        (results,) = world.run(_stage, checkpoint, "dist", dtype)
    assert set(results) == {"1x1"}
    _check(results, dtype)


@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_on_two_gpus(checkpoint: str, backend: str, dtype: str) -> None:
    with LocalWorld(2, devices=["cuda:0", "cuda:1"], backend="nccl", timeout=600) as world:
        per_rank = world.run(_stage, checkpoint, backend, dtype)
    for results in per_rank:
        assert set(results) == {"1x2", "2x1"}
        assert results["1x2"]["backend"] == backend
        _check(results, dtype)
    for layout in ("1x2", "2x1"):  # every rank ends with the same latents
        assert per_rank[0][layout]["final_sum"] == per_rank[1][layout]["final_sum"]
