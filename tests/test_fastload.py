"""`StagedSafetensorsLoader`: the same state dict as ltx-core's loader (keys, dtypes, shapes, bytes, key ops),
through many small chunks and several reader threads (CPU staging here; the CUDA path in
tests/test_fastload_gpu.py), and a damaged file is an error, never a hang or a silent short tensor."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from safetensors.torch import load_file, save_file

from ltx_mgpu.runners.common.fast_load import StagedSafetensorsLoader, read_header

pytestmark = pytest.mark.timeout(120)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "model.diffusion_model.a.weight": torch.randn(37, 19, generator=gen).to(torch.bfloat16),
        "model.diffusion_model.a.bias": torch.randn(37, generator=gen),
        "model.diffusion_model.empty": torch.empty(0, 4),
        "model.diffusion_model.mask": torch.rand(5, 3, generator=gen) > 0.5,
        "model.diffusion_model.fp8": torch.randn(8, 8, generator=gen).to(torch.float8_e4m3fn),
        "model.diffusion_model.idx": torch.arange(11, dtype=torch.int64),
        "vae.decoder.w": torch.randn(3, 300, generator=gen).half(),
        "vocoder.x": torch.randn(1000, generator=gen),
    }


@pytest.mark.parametrize(("chunk", "readers"), [(7, 3), (64, 1), (1 << 20, 4)])
def test_same_tensors_as_safetensors_in_any_chunking(tmp_path, chunk: int, readers: int) -> None:
    path = tmp_path / "c.safetensors"
    save_file(_tensors(), str(path), {"config": '{"x": 1}'})
    loader = StagedSafetensorsLoader(chunk_bytes=chunk, buffers=3, readers=readers, stage_cpu=True)
    got = loader.load(str(path), None, torch.device("cpu")).sd
    want = load_file(str(path))
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    assert loader.metadata(str(path)) == {"x": 1}
    begins = [e.begin for e in read_header(str(path))[0]]
    assert begins == sorted(begins)


def test_key_ops_select_and_rename_like_ltx_core(tmp_path) -> None:
    from ltx_core.loader.sft_loader import SafetensorsStateDictLoader
    from ltx_core.model.transformer.model_configurator import LTXV_MODEL_COMFY_RENAMING_MAP

    path = tmp_path / "c.safetensors"
    save_file(_tensors(), str(path))
    staged = StagedSafetensorsLoader(chunk_bytes=16, buffers=2, readers=2, stage_cpu=True)
    got = staged.load([str(path)], LTXV_MODEL_COMFY_RENAMING_MAP, torch.device("cpu"))
    want = SafetensorsStateDictLoader().load([str(path)], LTXV_MODEL_COMFY_RENAMING_MAP, torch.device("cpu"))
    assert set(got.sd) == set(want.sd) and got.sd and "vae.decoder.w" not in got.sd
    assert all(torch.equal(got.sd[k].view(torch.uint8), want.sd[k].view(torch.uint8)) for k in want.sd)
    assert got.size == want.size and got.dtype == want.dtype


def test_a_truncated_file_is_an_error_not_a_hang(tmp_path) -> None:
    path = tmp_path / "c.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 500])
    with pytest.raises(OSError, match="short read"):
        StagedSafetensorsLoader(chunk_bytes=32, buffers=2, readers=3, stage_cpu=True).load(str(path), None, "cpu")


def test_cpu_destinations_use_ltx_cores_loader_unless_asked(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.safetensors"
    save_file(_tensors(), str(path))
    loader = StagedSafetensorsLoader()
    monkeypatch.setattr(loader, "_copy", lambda *a: (_ for _ in ()).throw(AssertionError("staged on CPU")))
    assert set(loader.load(str(path), None, torch.device("cpu")).sd) == set(_tensors())


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_read_tensors_gives_the_named_tensors_as_views_of_one_allocation(tmp_path, chunk: int) -> None:
    """What a LoRA's factor reads use: any subset by file name, the file's bytes, one allocation, tensors
    that follow each other in the file adjacent (one copy for a run, not one per tensor), dtypes aligned."""
    path = tmp_path / "r.safetensors"
    save_file(_tensors(), str(path))
    want = load_file(str(path))
    loader = StagedSafetensorsLoader(chunk_bytes=chunk, buffers=3, readers=2, stage_cpu=True)
    names = [*sorted(want)[::2], "vocoder.x"]  # a subset, asked in another order than the file's
    got = loader.read_tensors(str(path), names, "cpu")
    assert set(got) == set(names)
    for name in names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    storages = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    assert len(storages) == 1
    everything = loader.read_tensors(str(path), list(want), "cpu")
    entries = read_header(str(path))[0]
    base, runs = min(t.data_ptr() for t in everything.values() if t.numel()), 0
    for before, after in pairwise(entries):  # (every tensor of the file: each follows its predecessor there)
        a, b = everything[before.name], everything[after.name]
        if before.nbytes and after.nbytes and (a.data_ptr() - base + before.nbytes) % 16 == 0:
            assert b.data_ptr() - a.data_ptr() == after.begin - before.begin, (before.name, after.name)
            runs += 1
    assert runs  # (the file has tensors of 16-byte multiples: some do travel as one run)
    for t in everything.values():
        assert t.numel() == 0 or (t.data_ptr() - base) % 16 == 0  # (GEMM kernels want 16-byte aligned operands)
    with pytest.raises(KeyError, match="no tensor named"):
        loader.read_tensors(str(path), ["vocoder.x", "not.there"], "cpu")


class _CastWeights:
    """A quantization's shape of key-value op: each weight replaced by a cast (and its scale added), the rest
    kept, one tensor filed under a second key; it notes the storage size of every original it is handed."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def apply_to_key(self, key: str) -> str:
        return key

    def apply_to_key_value(self, key: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.seen[key] = value.untyped_storage().nbytes()
        if key.endswith(".weight"):
            return [(key, value.to(torch.float16)), (key.replace("weight", "scale"), value.abs().amax(dim=1))]
        if key == "tied.table":
            return [(key, value), ("tied.head", value)]
        return [(key, value)]


def _weights_file(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    tensors = {f"b.{i}.weight": torch.randn(32, 16, generator=gen) for i in range(12)}  # 2 KiB each
    tensors |= {f"b.{i}.bias": torch.randn(32, generator=gen) for i in range(12)}
    tensors["big.weight"] = torch.randn(64, 64, generator=gen)  # 16 KiB: over the group limit, alone
    tensors["tied.table"] = torch.randn(8, 4, generator=gen)
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    return path, tensors


def test_value_ops_run_group_by_group_so_the_originals_never_sit_together(tmp_path, monkeypatch) -> None:
    """With key-value ops that replace tensors (a quantization at load), at most `group_bytes` of the file's
    originals (plus each tensor's 256-byte alignment) are read before the ops see them and let them go; the
    result is the ops applied to the whole file, every kept tensor off the shared allocation, a tensor filed
    under two keys still one tensor, and one staging ring serves the whole file."""
    path, tensors = _weights_file(tmp_path)
    limit = 6 << 10
    loader = StagedSafetensorsLoader(chunk_bytes=1000, buffers=3, readers=2, group_bytes=limit, stage_cpu=True)
    rings = []
    make_ring = loader._staging
    monkeypatch.setattr(loader, "_staging", lambda *a: rings.append(a) or make_ring(*a))
    ops = _CastWeights()
    got = loader.load(path, ops, torch.device("cpu")).sd
    reference = _CastWeights()
    want = {k: v for key, t in tensors.items() for k, v in reference.apply_to_key_value(key, t.clone())}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert len(rings) == 1
    whole = sum(t.nbytes for t in tensors.values())
    for key, storage in ops.seen.items():  # (a group: its tensors' bytes, each padded to 256, at most)
        assert storage <= max(limit, tensors[key].nbytes) + 256 * len(tensors) < whole, (key, storage)
    assert ops.seen["big.weight"] <= tensors["big.weight"].nbytes + 256  # (larger than a group: alone)
    kept = [got[k] for k in got if k.endswith(".bias") or k.startswith("tied.")]
    assert len({t.untyped_storage().data_ptr() for t in kept}) == len(kept) - 1  # own storage; the pair shares one
    assert got["tied.head"] is got["tied.table"]


def test_without_value_ops_a_file_is_still_one_allocation(tmp_path) -> None:
    """Key ops that only select and rename leave nothing to drop early: one read, one allocation, as before."""
    from ltx_core.loader.sd_ops import SDOps

    path, tensors = _weights_file(tmp_path)
    loader = StagedSafetensorsLoader(chunk_bytes=1000, buffers=3, readers=2, group_bytes=1 << 10, stage_cpu=True)
    got = loader.load(path, SDOps("all").with_matching(), torch.device("cpu")).sd
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1


def test_a_converting_loads_transient_fits_in_the_memory_plans_headroom() -> None:
    """The plan does not model setup: what a quantizing load holds beyond the loaded model (one group of
    originals, and the fp32 copy `quantize_weight` makes of the largest weight, 4096 x 16384 in the 19B
    transformer: `lora_unit_gib` is its bf16 size) must fit in the headroom every admission keeps free."""
    from ltx_mgpu.spec.memory_plan import DEFAULT_HEADROOM_GIB, GIB, LTX2_19B

    transient = StagedSafetensorsLoader().group_bytes + 2 * LTX2_19B.lora_unit_gib * GIB
    assert transient < DEFAULT_HEADROOM_GIB * GIB
