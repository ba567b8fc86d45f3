"""Synthetic checkpoints: the full-size plan is what the real loaders expect, the streaming writer writes
exactly the planned bytes, and the tiny profile written by the CLI loads through the real loaders.

The full profile (LTX-2 19B, Gemma 3 12B: ~75 GB) is checked without writing it: every file's plan (keys,
shapes, dtypes) is run through each loader's own key mapping (ltx-core's sd ops, ours for Gemma) against
the model that loader builds on the meta device from the plan's metadata config. Every tensor a loader
needs is planned with its shape, and every planned tensor is used by some loader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ltx_mgpu.runners.common.weights import TensorSpec, fill, module_specs, write_safetensors
from ltx_mgpu.runners.ltx2.synthetic import Ltx2Files, plan_files, write_checkpoints


def _header_only(path: Path, metadata: dict[str, str]) -> str:
    """A safetensors file with the plan's metadata and no tensors: enough for a builder's config + meta model."""
    write_safetensors(path, [], seed=0, metadata=metadata)
    return str(path)


def _check_loaders(plan, builders: dict) -> None:
    planned = {s.name: s for s in plan.specs}
    used: set[str] = set()
    for what, builder in builders.items():
        meta = builder.meta_model(builder.model_config(), ())
        expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        provided = {}
        ops = builder.model_sd_ops
        for name, spec in planned.items():  # what ltx-core's safetensors loader does with each file key
            key = name if ops is None else ops.apply_to_key(name)
            if key is None:
                continue
            tensor = torch.empty(spec.shape, device="meta")
            for new_key, value in [(key, tensor)] if ops is None else ops.apply_to_key_value(key, tensor):
                if new_key in expected:
                    provided[new_key] = tuple(value.shape)
                    used.add(name)
        missing = sorted(set(expected) - set(provided))
        assert not missing, f"{what}: {len(missing)} tensors not planned, e.g. {missing[:3]}"
        wrong = {k: (provided[k], expected[k]) for k in expected if provided[k] != expected[k]}
        assert not wrong, f"{what}: shapes differ: {list(wrong.items())[:3]}"
    assert not set(planned) - used, f"planned but read by no loader: {sorted(set(planned) - used)[:3]}"


@pytest.fixture(scope="module")
def full_plans():
    return {p.relpath: p for p in plan_files("full")}


def test_full_monolith_plan_is_what_every_loader_reads(full_plans, tmp_path):
    from ltx_mgpu.runners.common.audio import audio_decoder_builder, vocoder_builder
    from ltx_mgpu.runners.ltx2 import components as comp
    from ltx_mgpu.runners.ltx2.gemma_loading import embeddings_processor_builder

    plan = full_plans["ltx2.safetensors"]
    path = _header_only(tmp_path / "ltx2.safetensors", plan.metadata)
    builders = {
        "transformer": comp.transformer_builder(path),
        "video decoder": comp.video_decoder_builder(path),
        "video encoder": comp.video_encoder_builder(path),
        "audio decoder": audio_decoder_builder(path),
        "vocoder": vocoder_builder(path),
        "embeddings processor": embeddings_processor_builder(path),
    }
    _check_loaders(plan, builders)
    # published dimensions: an 18.9 B transformer (+0.7 B text connectors) in bfloat16, audio in float32
    params = {s.name: s.nbytes // s.dtype.itemsize for s in plan.specs}
    core = sum(n for k, n in params.items() if k.startswith("model.diffusion_model.") and "_connector." not in k)
    assert 18.5e9 < core < 19.5e9, core
    dtypes = {s.name.split(".")[0]: s.dtype for s in plan.specs}
    assert dtypes["model"] == torch.bfloat16 and dtypes["vocoder"] == torch.float32
    config = json.loads(plan.metadata["config"])
    assert config["transformer"]["num_layers"] == 48 and config["transformer"]["caption_channels"] == 3840
    assert plan.metadata["synthetic"] == "true"


def test_full_upsampler_and_lora_plans(full_plans, tmp_path):
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

    from ltx_mgpu.runners.ltx2 import components as comp
    from ltx_mgpu.runners.ltx2.synthetic.plan import transformer_meta
    from ltx_mgpu.runners.ltx2.synthetic.profiles import full

    plan = full_plans["upsampler.safetensors"]
    _check_loaders(
        plan, {"upsampler": comp.upsampler_builder(_header_only(tmp_path / "up.safetensors", plan.metadata))}
    )
    # LoRA: every A/B pair maps (with the loader's key map) onto a linear weight of the transformer, rank 384
    weights = {k: tuple(v.shape) for k, v in transformer_meta(full()).state_dict().items()}
    lora = full_plans["distilled_lora.safetensors"].specs
    pairs = {}
    for spec in lora:
        module, _, kind = LTXV_LORA_COMFY_RENAMING_MAP.apply_to_key(spec.name).rpartition(".lora_")
        pairs.setdefault(module, {})[kind] = spec.shape
    assert len(pairs) == len(lora) // 2 == 1344  # 48 blocks x 28 linear layers
    for module, ab in pairs.items():
        out_features, in_features = weights[f"{module}.weight"]
        assert ab == {"A.weight": (384, in_features), "B.weight": (out_features, 384)}, module


def test_full_gemma_plan_tokenizer_and_config(full_plans, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from ltx_mgpu.runners.ltx2.gemma_loading import gemma_builder
    from ltx_mgpu.runners.ltx2.synthetic.gemma_files import (
        GEMMA_VOCAB_SIZE,
        build_tokenizer,
        gemma_config,
        write_side_files,
    )
    from ltx_mgpu.runners.ltx2.synthetic.profiles import full

    root = tmp_path / "gemma"
    tok = build_tokenizer(full_vocab=True)
    config = gemma_config(full(), tok)
    write_side_files(root, full(), tok, config)
    shards = [p for name, p in sorted(full_plans.items()) if name.startswith("gemma/")]
    assert [Path(p.relpath).name for p in shards] == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    for shard in shards:
        _header_only(tmp_path / shard.relpath, shard.metadata)
    merged = type(shards[0])("gemma", "gemma", [s for p in shards for s in p.specs])
    _check_loaders(merged, {"gemma": gemma_builder(root)})
    embed = next(s for s in merged.specs if s.name.endswith("embed_tokens.weight"))
    assert embed.shape == (GEMMA_VOCAB_SIZE, 3840) and config["text_config"]["vocab_size"] == GEMMA_VOCAB_SIZE
    hf = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))
    assert len(hf) == GEMMA_VOCAB_SIZE
    specials = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<image_soft_token>")
    assert [hf.convert_tokens_to_ids(t) for t in specials] == [0, 1, 2, 105, 262144]
    assert (config["image_token_index"], config["boi_token_index"], config["eos_token_id"]) == (
        262144,
        255999,
        [1, 106],
    )
    ids = hf("a cat walks along the beach")["input_ids"]
    assert (
        ids[0] == 2
        and all(0 <= i < GEMMA_VOCAB_SIZE for i in ids)
        and hf.decode(ids[1:]) == "a cat walks along the beach"
    )


# ---- the writer ------------------------------------------------------------------------------------------
def test_streamed_file_holds_exactly_the_planned_tensors(tmp_path):
    specs = [
        TensorSpec("big", (300, 70), torch.bfloat16, "normal", 0.5),  # many 1 KiB chunks, order matters
        TensorSpec("ones", (5,), torch.float32, "ones"),
        TensorSpec("zeros", (2, 3), torch.float16, "zeros"),
        TensorSpec("scalar", (), torch.float32, "normal", 1.0),
    ]
    rows = [write_safetensors(tmp_path / f"{i}.safetensors", specs, seed=5, metadata={"k": "v"}, chunk_bytes=1024)
            for i in range(2)]  # fmt: skip
    assert rows[0]["bytes"] == (tmp_path / "0.safetensors").stat().st_size
    assert (tmp_path / "0.safetensors").read_bytes() == (tmp_path / "1.safetensors").read_bytes()
    with safe_open(str(tmp_path / "0.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"} and list(f.keys()) == ["big", "ones", "scalar", "zeros"]
        for spec in specs:
            assert torch.equal(f.get_tensor(spec.name), fill(spec, 5, "cpu")), spec.name
    big = fill(specs[0], 5, "cpu").float()
    assert abs(big.std().item() - 0.5) < 0.02 and not torch.equal(big, fill(specs[0], 6, "cpu").float())


def test_fill_rules_follow_the_module(tmp_path):
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Conv2d(4, 2, 3))
    rules = {s.name: (s.init, round(s.std, 4)) for s in module_specs(block, dtype=torch.bfloat16)}
    assert rules == {
        "0.weight": ("normal", round(8**-0.5, 4)),
        "0.bias": ("zeros", 0.0),
        "1.weight": ("ones", 0.0),
        "1.bias": ("zeros", 0.0),
        "2.weight": ("normal", round(36**-0.5, 4)),
        "2.bias": ("zeros", 0.0),
    }


# ---- tiny, end to end through the CLI and the loaders -------------------------------------------------------
def test_cli_writes_a_tiny_subset_that_the_loaders_load(tmp_path):
    from ltx_mgpu.runners.common.audio import build_audio_decoding
    from ltx_mgpu.runners.common.loading import build_checked, checkpoint_metadata
    from ltx_mgpu.runners.ltx2 import components as comp

    out = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "ltx_mgpu.runners.ltx2.synthetic", "--profile", "tiny", "--out", str(out),
           "--device", "cpu", "--components", "monolith,upsampler"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r.get("component") for r in rows] == ["monolith", "upsampler", None]
    assert rows[-1]["event"] == "done" and rows[-1]["bytes"] == sum(r["bytes"] for r in rows[:-1]) > 0
    assert all(r["bytes"] == Path(r["file"]).stat().st_size and r["seconds"] >= 0 for r in rows[:-1])
    files = Ltx2Files.under(out)
    assert files.checkpoint.exists() and files.upsampler.exists()
    assert not files.distilled_lora.exists() and not files.gemma_root.exists()  # not asked for
    assert checkpoint_metadata(files.checkpoint)["synthetic"] == "true"
    cpu = torch.device("cpu")
    ckpt = str(files.checkpoint)
    for make in (comp.transformer_builder, comp.video_decoder_builder, comp.video_encoder_builder):
        build_checked(make(ckpt), cpu, torch.float32, "component")
    build_checked(comp.upsampler_builder(str(files.upsampler)), cpu, torch.float32, "upsampler")
    audio = build_audio_decoding(str(files.checkpoint), cpu, torch.float32)
    assert torch.isfinite(audio.decode(torch.randn(1, 8, 10, 16)).waveform).all()
    bad = subprocess.run([*cmd[:-1], "monolith,vae"], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "unknown components ['vae']" in bad.stderr


def test_same_seed_same_bytes_any_subset(tmp_path):
    a = write_checkpoints("tiny", tmp_path / "a", seed=3, components=["upsampler", "lora"])
    b = write_checkpoints("tiny", tmp_path / "b", seed=3, components=["lora"])
    assert a.distilled_lora.read_bytes() == b.distilled_lora.read_bytes()
    c = write_checkpoints("tiny", tmp_path / "c", seed=4, components=["lora"])
    assert a.distilled_lora.read_bytes() != c.distilled_lora.read_bytes()
