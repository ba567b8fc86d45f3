"""The tracker's device cache of past request LoRAs' factors: recent LoRAs stay on the device.

A switch A -> B -> A with the cache reads A's file once and gives the same weight bytes as without it; the
cache never holds more than its budget, dropping the least recently used LoRA first; the runners' setting
reaches the memory plan as its own per-rank line.
"""

from __future__ import annotations

import pytest
import torch
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP as OPS

from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker
from ltx_mgpu.runners.ltx2.distilled import Ltx2DistilledRunner
from ltx_mgpu.spec.memory_plan import LTX2_19B, FleetMemory, lora_parts, plan
from tests.test_memplan_loras import _tiny_model, _write_lora


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model and three request LoRAs of different ranks (so their factor bytes differ)."""
    folder = tmp_path_factory.mktemp("loras")
    model = _tiny_model()
    files = {name: _write_lora(folder / f"{name}.safetensors", model, rank) for name, rank in
             (("a", 8), ("b", 4), ("c", 2))}  # fmt: skip
    return model, files


def _run(model, files, sequence, cache_bytes, factor_reader=None):
    """Each job's swap as the runner does it (`keep_factors`: the setup's LoRAs, none here); after every swap
    the weights' bytes and the file bytes read."""
    work = {k: v.clone() for k, v in model.state_dict().items()}
    clone = _tiny_model()
    clone.load_state_dict(work)
    tracker = LoraWeightTracker(device_cache_bytes=cache_bytes, factor_reader=factor_reader)
    tracker.attach(clone)
    out = []
    for name, strength in sequence:
        before = tracker.stats["lora_bytes_read"]
        specs = [LoraSpec(files[name], strength, OPS)] if name else []
        tracker.apply(specs, keep_factors=())
        weights = {k: v.clone() for k, v in clone.state_dict().items()}
        out.append((weights, tracker.stats["lora_bytes_read"] - before, tracker))
    return out


def _factor_bytes(tracker, path):
    return sum(t.nbytes for (p, _), kept in tracker._factors.items() if p == path for t in kept.values())


def test_switching_back_reads_nothing_and_gives_the_same_bytes(setup) -> None:
    model, files = setup
    sequence = [("a", 0.8), ("b", 1.0), ("a", 0.8), ("a", 0.5), (None, 0.0), ("b", 1.0)]
    plain = _run(model, files, sequence, 0)
    cached = _run(model, files, sequence, 1 << 30)
    for (w0, _, _), (w1, _, _) in zip(plain, cached, strict=True):
        assert w0.keys() == w1.keys()
        for key in w0:
            assert torch.equal(w0[key].view(torch.uint8), w1[key].view(torch.uint8)), key
    read_plain = [n for _, n, _ in plain]
    read_cached = [n for _, n, _ in cached]
    assert read_plain[2] > 0 and read_plain[5] > 0  # without the cache: A and B read again
    # with it: A back (and at another strength: the factors do not depend on it), then B back, read nothing
    assert read_cached[0] > 0 and read_cached[1] > 0 and read_cached[2:] == [0, 0, 0, 0]


def test_the_cache_holds_at_most_its_budget_least_recently_used_dropped_first(setup) -> None:
    model, files = setup
    a_bytes = _factor_bytes(_run(model, files, [("a", 1.0)], 0)[0][2], files["a"])
    b_bytes = _factor_bytes(_run(model, files, [("b", 1.0)], 0)[0][2], files["b"])
    c_bytes = _factor_bytes(_run(model, files, [("c", 1.0)], 0)[0][2], files["c"])
    assert a_bytes > b_bytes > c_bytes > 0
    budget = a_bytes  # room for A alone, or for B and C together
    runs = _run(model, files, [("a", 1.0), ("b", 1.0), ("c", 1.0), ("b", 1.0), ("a", 1.0), ("c", 1.0)], budget)
    tracker = runs[-1][2]
    # C: A (the least recent) dropped for it, B kept; B back: nothing read; A back: read again, and C and B
    # (0.75 of A) both kept; C back: nothing read, B (now the least recent) dropped so A fits
    assert [n for _, n, _ in runs] == [a_bytes, b_bytes, c_bytes, 0, a_bytes, 0]
    held = {p: _factor_bytes(tracker, p) for p in files.values()}
    assert held == {files["a"]: a_bytes, files["b"]: 0, files["c"]: c_bytes}  # C current, A cached
    tracker.drop_factors([])  # nothing current: A (older than C) goes
    assert tracker.held_bytes()["factors"] == c_bytes <= budget


def test_the_runners_setting_is_its_own_line_in_the_memory_plan(monkeypatch) -> None:
    from click.testing import CliRunner

    from worker.cli import main

    fleet = Ltx2DistilledRunner.memory_fleet(1, request_loras=True, lora_device_cache_gib=3.5)
    assert lora_parts(fleet, LTX2_19B)["lora_cache"] == 3.5
    without = Ltx2DistilledRunner.memory_fleet(1, request_loras=True, lora_device_cache_gib=0)
    assert "lora_cache" not in lora_parts(without, LTX2_19B)
    default = Ltx2DistilledRunner.memory_fleet(1, request_loras=True)  # the setup's default is planned for
    assert (
        lora_parts(default, LTX2_19B)["lora_cache"]
        == Ltx2DistilledRunner.setup_default("lora_device_cache_gib", {})
        == 4.0
    )
    assert "lora_cache" not in lora_parts(Ltx2DistilledRunner.memory_fleet(1), LTX2_19B)  # no request LoRAs
    with_cache, plain = plan(fleet, 768, 512, 121), plan(without, 768, 512, 121)
    assert with_cache.resident_gib[0]["lora_cache"] == 3.5
    assert with_cache.peak.allocated_gib == pytest.approx(plain.peak.allocated_gib + 3.5, abs=0.01)
    assert FleetMemory.from_json(fleet.to_json()) == fleet  # what the producer reads back
    with pytest.raises(ValueError, match="lora_device_cache_gib"):
        FleetMemory("distilled", 1, lora_device_cache_gib=-1.0)
    monkeypatch.setenv("LTX_RUNNER_SETUP", '{"request_loras": true, "lora_device_cache_gib": 3.5}')
    monkeypatch.delenv("LTX_DEVICE_MEMORY_GIB", raising=False)
    args = ["plan", "--runner", "ltx2-distilled", "--group", "0", "--size", "768x512x121", "--free-gib", "139.5"]
    out = CliRunner().invoke(main, args)
    assert "lora_cache" in out.output and "3.50" in out.output, out.output


def test_the_staged_factor_reader_fuses_the_same_bytes_and_reads_each_file_once(setup) -> None:
    """The runners read factors through `fast_load` (one staged read per file, not one copy per tensor): the
    weights after every swap are those of the tensor-by-tensor read, byte for byte, for the same file bytes."""
    from ltx_mgpu.runners.common.fast_load import StagedSafetensorsLoader

    model, files = setup
    reads: list[tuple[str, int]] = []
    loader = StagedSafetensorsLoader(chunk_bytes=4096, buffers=3, readers=2, stage_cpu=True)

    def reader(path, names, device):
        reads.append((path, len(names)))
        return loader.read_tensors(path, names, device)

    sequence = [("a", 0.8), ("b", 1.0), ("a", 0.5), (None, 0.0), ("c", 1.0)]
    plain = _run(model, files, sequence, 1 << 30)
    staged = _run(model, files, sequence, 1 << 30, factor_reader=reader)
    for (w0, read0, _), (w1, read1, _) in zip(plain, staged, strict=True):
        assert read0 == read1
        for key in w0:
            assert torch.equal(w0[key].view(torch.uint8), w1[key].view(torch.uint8)), key
    assert [p for p, _ in reads] == [files["a"], files["b"], files["c"]]  # cached after the first read
    assert all(n > 0 and n % 2 == 0 for _, n in reads)  # lora_A and lora_B of each key
