"""LoRA weight tracker: on 2 CPU ranks (and on one process) the fused weights are bit-identical to ltx-core's
single-process fusion (`SingleGPUModelBuilder(...).lora(...).build()`), switching sets works, and reset
restores the exact clean bytes. A tiny staging bucket forces tensors to be split across broadcast rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker, assign_owners
from ltx_mgpu.parallel.testing import LocalWorld


def write_checkpoint(path: Path) -> Path:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
    from safetensors.torch import save_file

    from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

    cfg = tiny_transformer_config()
    model = LTXModelConfigurator.from_config(cfg).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for name, p in sorted(model.state_dict().items()):
        sd[f"model.diffusion_model.{name}"] = (torch.randn(p.shape, generator=gen) * 0.05).to(torch.bfloat16)
    save_file(sd, str(path), metadata={"config": json.dumps(cfg)})
    return path


def write_lora(path: Path, checkpoint: Path, *, seed: int, every: int, rank: int = 4) -> Path:
    """A ComfyUI-style LoRA ("diffusion_model." prefix) over every `every`-th linear weight."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    out = {}
    with safe_open(str(checkpoint), framework="pt") as f:
        names = sorted(k for k in f.keys() if k.endswith(".weight") and len(f.get_slice(k).get_shape()) == 2)
        for i, name in enumerate(names):
            if i % every:
                continue
            rows, cols = f.get_slice(name).get_shape()
            prefix = "diffusion_model." + name[len("model.diffusion_model.") : -len(".weight")]
            out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, cols, generator=gen) * 0.1).to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(rows, rank, generator=gen) * 0.1).to(torch.bfloat16)
    save_file(out, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    ckpt = write_checkpoint(root / "transformer.safetensors")
    return {
        "ckpt": str(ckpt),
        "a": str(write_lora(root / "a.safetensors", ckpt, seed=1, every=2)),
        "b": str(write_lora(root / "b.safetensors", ckpt, seed=2, every=3)),
    }


def builder(ckpt: str, loras=()):
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator

    b = SingleGPUModelBuilder(LTXModelConfigurator, ckpt, model_sd_ops=LTXV_MODEL_COMFY_RENAMING_MAP)
    for path, strength in loras:
        b = b.lora(path, strength, _lora_ops())
    return b


def _lora_ops():
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

    return LTXV_LORA_COMFY_RENAMING_MAP


def reference_sd(ckpt: str, loras) -> dict[str, torch.Tensor]:
    model = builder(ckpt, loras).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _swap_sequence(ctx, files, bucket_bytes):
    """Build clean, then: A+B, B at 0.5, reset. Return the state dicts after each step."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None
    model = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    tracker = LoraWeightTracker(group, bucket_bytes=bucket_bytes)
    tracker.attach(model)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    snapshots = []
    ops = _lora_ops()
    for loras in ([(files["a"], 1.0), (files["b"], 0.7)], [(files["b"], 0.5)], []):
        tracker.apply([LoraSpec(p, s, ops) for p, s in loras])
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
    assert ptrs == {k: v.data_ptr() for k, v in model.state_dict().items()}  # in place: addresses kept
    return snapshots, tracker.owned_bytes(), dict(tracker.stats)


def _check(snapshots, files):
    clean = reference_sd(files["ckpt"], [])
    expected = [
        reference_sd(files["ckpt"], [(files["a"], 1.0), (files["b"], 0.7)]),
        reference_sd(files["ckpt"], [(files["b"], 0.5)]),
        clean,
    ]
    assert any(not torch.equal(expected[0][k], clean[k]) for k in clean)  # the LoRAs do change weights
    for got, want in zip(snapshots, expected, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_single_process_matches_ltx_core_fusion(files):
    snapshots, owned, stats = _swap_sequence(None, files, 1 << 20)
    assert owned > 0
    _check(snapshots, files)
    assert stats["bytes_broadcast"] == 0 and stats["swaps"] == 3


@pytest.fixture(scope="module")
def world():
    with LocalWorld(2) as w:
        yield w


def test_two_ranks_match_ltx_core_fusion_and_reset_is_exact(world, files):
    results = world.run(_swap_sequence, files, 4096)  # 4 KiB bucket: most tensors span several rounds
    total = sum(
        v.numel() * v.element_size()
        for k, v in reference_sd(files["ckpt"], []).items()
        if k.endswith(".weight") and v.dim() >= 2
    )
    owned = [r[1] for r in results]
    assert sum(owned) == total and min(owned) > 0.3 * total  # a sharded, roughly balanced clean backup
    for snapshots, _, stats in results:
        _check(snapshots, files)
        assert stats["bytes_broadcast"] > 0


def test_requests_are_validated_before_any_collective(files):
    model = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    tracker = LoraWeightTracker()
    with pytest.raises(RuntimeError, match="before attach"):
        tracker.apply([])
    tracker.attach(model)
    with pytest.raises(ValueError, match="LoRA file not found"):
        tracker.apply([LoraSpec("/nonexistent.safetensors", 1.0)])
    fp32 = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.float32)
    tracker32 = LoraWeightTracker()
    tracker32.attach(fp32)
    with pytest.raises(ValueError, match="Load the transformer in bfloat16"):
        tracker32.apply([LoraSpec(files["a"], 1.0, _lora_ops())])
    tracker.apply([(files["a"], 0.0, _lora_ops())])  # zero strength == no LoRA: a no-op
    assert tracker.current == () and tracker.stats["swaps"] == 0


def test_owner_assignment_is_deterministic_and_keeps_scales_together():
    sizes = {"a.weight": 100, "a.weight_scale": 4, "b.weight": 60, "c.weight": 50, "d.weight": 10}
    owners = assign_owners(sizes, 2)
    assert owners == assign_owners(dict(reversed(list(sizes.items()))), 2)
    assert owners["a.weight"] == owners["a.weight_scale"] == 0
    assert owners["b.weight"] == owners["c.weight"] == 1


def test_repeated_swaps_read_the_lora_files_once_and_stay_exact(files):
    """The two-stage runner swaps the distilled LoRA in and out on every job: after the first fusion the
    factors come from memory (no file read), and every swap still equals ltx-core's own fusion."""
    model = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    tracker = LoraWeightTracker(None)
    tracker.attach(model)
    spec = [LoraSpec(files["a"], 1.0, _lora_ops())]
    fused = reference_sd(files["ckpt"], [(files["a"], 1.0)])
    clean = reference_sd(files["ckpt"], [])
    read_after_first = None
    for _ in range(3):
        restored = tracker.stats["keys_restored"]
        tracker.apply(spec)
        assert all(torch.equal(v, fused[k]) for k, v in model.state_dict().items())
        assert tracker.stats["keys_restored"] == restored  # fusing into clean weights copies nothing back first
        read_after_first = read_after_first or tracker.stats["lora_bytes_read"]
        tracker.apply([])
        assert all(torch.equal(v, clean[k]) for k, v in model.state_dict().items())
        assert tracker.stats["keys_restored"] > restored  # the un-fuse restores the fused keys
    assert read_after_first > 0 and tracker.stats["lora_bytes_read"] == read_after_first
