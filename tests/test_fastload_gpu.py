"""The staged loader on a GPU: the tiny LTX-2 transformer and Gemma built through it equal the ones built by
ltx-core's own loader, bit for bit; a key op that replaces tensors does not keep the staging allocation alive,
and a quantizing load never holds more than a group of the file's originals beside what it has converted."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        assert sa[key].device.type == "cuda" and torch.equal(sa[key].cpu(), sb[key].cpu()), key


def test_tiny_transformer_and_gemma_equal_ltx_cores_load(tmp_path) -> None:
    from dataclasses import replace

    from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader

    from ltx_mgpu.runners.ltx2.components import transformer_builder
    from ltx_mgpu.runners.ltx2.gemma_loading import gemma_builder
    from ltx_mgpu.runners.ltx2.synthetic import write_checkpoints

    files = write_checkpoints("tiny", tmp_path, components=("monolith", "gemma"))
    device = torch.device("cuda", 0)
    staged = transformer_builder(str(files.checkpoint))
    plain = replace(staged, model_loader=SafetensorsModelStateDictLoader())
    _same(staged.build(device=device, dtype=torch.bfloat16), plain.build(device=device, dtype=torch.bfloat16))
    g_staged = gemma_builder(str(files.gemma_root))
    g_plain = replace(g_staged, model_loader=replace(g_staged.model_loader, weight_loader=None))
    _same(g_staged.build(device=device, dtype=torch.bfloat16), g_plain.build(device=device, dtype=torch.bfloat16))


def test_replaced_tensors_free_the_staging_allocation(tmp_path) -> None:
    from safetensors.torch import save_file

    from ltx_mgpu.runners.common.fast_load import StagedSafetensorsLoader

    path = tmp_path / "w.safetensors"
    save_file({"big.weight": torch.randn(4096, 4096), "big.bias": torch.randn(4096)}, str(path))

    class CastWeights:  # like a quantization's key-value op: weights replaced, biases kept
        def apply_to_key(self, key):
            return key

        def apply_to_key_value(self, key, value):
            return ((key, value.to(torch.float8_e4m3fn) if key.endswith("weight") else value),)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sd = StagedSafetensorsLoader().load(str(path), CastWeights(), torch.device("cuda", 0)).sd
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert sd["big.weight"].dtype == torch.float8_e4m3fn
    assert held < 4096 * 4096 * 2, held  # fp8 weight + bias; the 64 MiB fp32 staging copy is gone


def test_a_quantizing_load_holds_one_group_of_originals_at_a_time(tmp_path) -> None:
    """The fp8 transformer's load on a small card: 16 fp32 weights of 16 MiB cast to fp8 (4 MiB each) with
    groups of 32 MiB. The peak is the converted weights plus a group of originals plus the cast being made,
    well under the 256 MiB of originals a whole-file read put on the device (an fp8 fleet capped at 40 GiB ran
    out of memory that way at 39.7 GiB, for a 20.1 GiB transformer). The conversion of one group and the copies
    of the next run on different streams: the bytes are checked too."""
    from safetensors.torch import load_file, save_file

    from ltx_mgpu.runners.common.fast_load import StagedSafetensorsLoader

    gen = torch.Generator().manual_seed(7)
    path = tmp_path / "w.safetensors"
    save_file({f"b{i}.weight": torch.randn(2048, 2048, generator=gen) for i in range(16)}, str(path))

    class CastWeights:  # (no ltx-core `mapping` to read: the loader assumes its value ops may replace)
        def apply_to_key(self, key):
            return key

        def apply_to_key_value(self, key, value):
            return ((key, value.to(torch.float8_e4m3fn)),)

    mib = 1 << 20
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loader = StagedSafetensorsLoader(chunk_bytes=8 * mib, group_bytes=32 * mib)
    sd = loader.load(str(path), CastWeights(), torch.device("cuda", 0)).sd
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    converted = 16 * 4 * mib
    assert peak <= converted + 32 * mib + 4 * mib + mib, peak / mib  # (+1 MiB: alignment, the allocator's rounding)
    want = load_file(str(path), device="cuda:0")
    for key, value in want.items():
        assert torch.equal(sd[key].view(torch.uint8), value.to(torch.float8_e4m3fn).view(torch.uint8)), key


def test_read_tensors_to_the_gpu_are_the_files_bytes(tmp_path) -> None:
    """A LoRA's factors as the tracker reads them on a GPU rank: the file's bytes, read in big pieces."""
    from safetensors.torch import load_file, save_file

    from ltx_mgpu.runners.common.fast_load import StagedSafetensorsLoader

    gen = torch.Generator().manual_seed(5)
    tensors = {f"b.{i}.lora_{ab}.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16)
               for i in range(40) for ab in "AB"}  # fmt: skip
    path = tmp_path / "l.safetensors"
    save_file(tensors, str(path))
    names = sorted(tensors)[5:61]
    got = StagedSafetensorsLoader(chunk_bytes=1 << 16).read_tensors(str(path), names, "cuda:0")
    want = load_file(str(path))
    assert all(got[n].is_cuda and torch.equal(got[n].cpu().view(torch.uint8), want[n].view(torch.uint8)) for n in names)
