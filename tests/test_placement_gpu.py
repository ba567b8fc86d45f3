"""The placement's host tiers on a CUDA device (docs/memory.md, "Placement"): a parked module frees its GPU
memory and comes back byte for byte in one copy from page-locked memory; the LoRA tracker with its clean copy
and its factors in host memory fuses and restores (also asynchronously, beside other work) exactly what the
all-GPU tracker does; the tiny two-stage runner renders the same frames with every component in host memory and
its text encoder parked as with everything on the GPU, and its setup leaves no allocator cache behind.

    pytest -q -m gpu tests/test_placement_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker
from ltx_mgpu.runners.common.host_tier import ParkableWeights, pinned_buffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]
CUDA = torch.device("cuda", 0)


def test_pinned_buffer_is_page_locked_and_exact_size():
    buf = pinned_buffer(3 * (1 << 20) + 5, CUDA)
    assert buf.numel() == 3 * (1 << 20) + 5 and buf.is_pinned()


@torch.inference_mode()  # (as the runners run: an autograd graph would keep the parked weights alive)
def test_a_parked_module_frees_its_memory_and_returns_byte_for_byte(monkeypatch):
    from ltx_mgpu.runners.common import host_tier

    monkeypatch.setattr(host_tier, "PIECE_BYTES", 5 << 20)  # (several pieces: two layers' weights in each)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, dtype=torch.bfloat16) for _ in range(8)]).to(CUDA)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device=CUDA)
    before = model(x)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    parkable = ParkableWeights(model, CUDA)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA)
    parkable.park()
    assert held - torch.cuda.memory_allocated(CUDA) >= params  # the GPU copy is gone
    assert all(p.device.type == "cpu" for p in model.parameters())
    parkable.unpark()
    parkable.ensure()
    assert all(p.device == CUDA for p in model.parameters())
    assert torch.equal(model(x), before)
    assert parkable.describe()["pinned"] and parkable.stats == {"parks": 1, "unparks": 1}
    assert parkable.describe()["pieces"] == 4


@torch.inference_mode()
def test_a_streamed_layer_stack_holds_two_layers_and_computes_what_the_resident_one_does():
    """`StreamedLayers` on a GPU: the output equals the resident stack's bit for bit, and the device holds two
    layers' weights (the running one and the next in flight), three at most while a parked layer's memory waits
    for its copy stream, never the stack: 12 layers of 8 MiB, bounded by 3 layers plus 4 MiB of activations."""
    from ltx_mgpu.runners.common.host_tier import StreamedLayers

    torch.manual_seed(1)
    layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048, dtype=torch.bfloat16) for _ in range(12))
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device=CUDA)

    def run() -> torch.Tensor:
        h = x
        for layer in layers:
            h = torch.tanh(layer(h)) + h
        return h

    layers.to(CUDA)
    expected = run()
    layers.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(CUDA)
    streamed = StreamedLayers(layers, CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    for _ in range(2):
        assert torch.equal(run(), expected)
    torch.cuda.synchronize()
    layer_bytes = streamed.largest_layer_bytes
    assert torch.cuda.max_memory_allocated(CUDA) - base <= 3 * layer_bytes + (4 << 20)
    assert streamed.describe()["on_device"] == 0 and streamed.describe()["pinned"]
    assert streamed.stats == {"forwards": 2, "copies": 24}


def _lora_file(path, model: torch.nn.Module, rank: int = 8) -> str:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith(".weight") and p.dim() == 2:
            prefix = name[: -len(".weight")]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, p.shape[1], generator=g, dtype=torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(p.shape[0], rank, generator=g, dtype=torch.bfloat16)
    save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_host_tier_tracker_fuses_and_restores_exactly_what_the_gpu_one_does(tmp_path, asynchronous):
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512, dtype=torch.bfloat16) for _ in range(4)]).to(CUDA)

    gpu_model, host_model = model(), model()
    lora = LoraSpec(_lora_file(tmp_path / "l.safetensors", gpu_model), 0.5)
    clean = {k: v.clone() for k, v in gpu_model.state_dict().items()}
    gpu = LoraWeightTracker(None)
    host = LoraWeightTracker(None, backup_device="cpu", factor_device="cpu")
    gpu.attach(gpu_model)
    host.attach(host_model)
    for _ in range(2):
        gpu.apply([lora])
        host.apply([lora])
        fused = host_model.state_dict()
        assert all(torch.equal(fused[k], v) for k, v in gpu_model.state_dict().items())
        gpu.reset()
        if asynchronous:
            assert host.reset_async()
            host.wait_restored()
        else:
            host.reset()
        torch.cuda.synchronize()
        assert all(torch.equal(host_model.state_dict()[k], v) for k, v in clean.items())


def test_two_stage_renders_the_same_frames_with_host_tiers_and_a_parked_text_encoder(tmp_path):
    from ltx_mgpu.media.mp4_read import read_mp4
    from ltx_mgpu.runners.common.local import LocalRunner
    from ltx_mgpu.runners.ltx2.runners import Ltx2TwoStageRunner
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    tiny = ensure_tiny_ltx2()
    job = {"prompt": "a cat walks along the beach", "width": 256, "height": 192, "num_frames": 17, "frame_rate": 8.0}
    setup = {**tiny.setup_kwargs(), "prompt_tokens": 128, "default_steps": 3, "tdp_overlap": 1}
    host = {"text_encoder": "park", "lora_backup": "host", "lora_factors": "host"}
    frames = {}
    for name, placement in (("gpu", None), ("host", host)):
        with LocalRunner(Ltx2TwoStageRunner, device="cuda:0") as local:
            gc.collect()  # (the previous runner's cycles: freed now, not between the two readings below)
            local.start(**setup, placement=placement)
            gc.disable()
            try:
                reserved = torch.cuda.memory_reserved(CUDA)  # setup handed back its cache: nothing left to free
                torch.cuda.empty_cache()
                assert torch.cuda.memory_reserved(CUDA) == reserved
            finally:
                gc.enable()
            plan = {"decode_chunked": False, "release_between_stages": False, "park_text_encoder": name == "host"}
            for i in range(2):  # the second job: after a park, an unpark and an asynchronous restore
                path = tmp_path / f"{name}{i}.mp4"
                list(local.stream(**job, seed=5, output_path=str(path), memory_plan=plan))
                frames[name, i] = read_mp4(path)[0]
            if name == "host":
                assert local.runner.parkable_text.stats == {"parks": 2, "unparks": 2}
    assert torch.equal(frames["gpu", 0], frames["gpu", 1])
    assert torch.equal(frames["host", 0], frames["gpu", 0]) and torch.equal(frames["host", 1], frames["gpu", 0])


def test_a_streamed_tiny_gemma_encodes_what_the_resident_one_does_with_its_table_on_the_host():
    """The `stream` tier's encoder on a GPU (the tiny real Gemma 3): its embeddings equal the resident encoder's
    bit for bit; the token table (and the head tied to it) and the vision tower stay in host memory and the
    embedding gathers there, from ids made on the device; the layers rest in pinned memory between encodes;
    the norm and the embeddings processor are on the device."""
    from ltx_mgpu.runners.ltx2.text import build_gemma_prompt_encoder
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    tiny = ensure_tiny_ltx2()
    prompts = ["a cat walks along the beach at sunset", "blurry, low quality"]

    def encoder(stream: bool):
        return build_gemma_prompt_encoder(
            tiny.gemma_root, str(tiny.checkpoint), device=CUDA, dtype=torch.bfloat16, max_tokens=128, stream=stream
        )

    resident = encoder(False).encode(prompts)
    streamed = encoder(True)
    gemma = streamed.text_encoder.model
    for first, second in zip(streamed.encode(prompts), resident, strict=True):
        for key in ("video", "audio", "mask"):
            assert first[key].device == second[key].device and torch.equal(first[key], second[key]), key
    assert gemma.get_input_embeddings().weight.device.type == "cpu"
    assert gemma.get_output_embeddings().weight is gemma.get_input_embeddings().weight
    assert all(p.device.type == "cpu" for p in gemma.model.vision_tower.parameters())
    assert gemma.model.language_model.norm.weight.device == CUDA
    assert all(p.device == CUDA for p in streamed.embeddings_processor.parameters())
    layers = streamed.streamed.describe()
    assert layers["on_device"] == 0 and layers["pinned"] and layers["copies"] == layers["layers"]
