"""Request LoRAs in the two-stage runner on tiny checkpoints, one process and 2 CPU ranks: a render with a
request LoRA equals a render from a checkpoint with that LoRA merged offline by ltx-core, and the next job
without it equals a fresh fleet's render, both exactly.

Why exact (tolerance 0) is the right bound here: ltx-core fuses a weight as one bf16 rounding of
`w + sum(strength * B @ A)` over the LoRAs touching it. The request LoRA below touches only weights the
distilled LoRA does not (the non-block projections), so every weight gets at most one delta in either path:
the tracker's stage-1 weights are bit-identical to the merged checkpoint's, and its stage-2 weights (request
+ distilled fused from clean) equal the merged checkpoint plus the distilled LoRA, key by key. Same weights,
same seed, same process layout: the same bits. (Where both LoRAs touch one weight the tracker rounds once
and a merged checkpoint twice, up to 1 bf16 ulp apart per element; that case is not compared here.)
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu import MGPUController, SymmetricRunnerError
from ltx_mgpu.runners.common.job_loras import model_targets
from ltx_mgpu.runners.common.local import LocalRunner
from ltx_mgpu.runners.ltx2.runners import Ltx2TwoStageRunner

from .test_ltx2_runners import JOB, START_TIMEOUT, _LocalCtl, render, two_stage_setup

STRENGTH = 0.7


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
    """A request LoRA over the weights the distilled LoRA leaves alone, and the checkpoint with it merged."""
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ltx_mgpu.lora_file import read_header, transformer_targets

    root = tmp_path_factory.mktemp("job-loras")
    kw = tiny.setup_kwargs()
    header = read_header(kw["distilled_lora_path"], max_file_bytes=1 << 40, max_header_bytes=1 << 30)
    distilled = {k.replace("diffusion_model.", "").rsplit(".lora_", 1)[0] + ".weight" for k in header}
    gen = torch.Generator().manual_seed(5)
    lora = {}
    for key, (rows, cols) in sorted(transformer_targets(kw["checkpoint_path"]).items()):
        if key not in distilled:
            prefix = "diffusion_model." + key[: -len(".weight")]
            lora[f"{prefix}.lora_A.weight"] = (torch.randn(4, cols, generator=gen) * 0.2).to(torch.bfloat16)
            lora[f"{prefix}.lora_B.weight"] = (torch.randn(rows, 4, generator=gen) * 0.2).to(torch.bfloat16)
    assert len(lora) >= 20
    lora_path = root / "user.safetensors"
    save_file(lora, str(lora_path))

    builder = SingleGPUModelBuilder(LTXModelConfigurator, kw["checkpoint_path"],
                                    model_sd_ops=LTXV_MODEL_COMFY_RENAMING_MAP)  # fmt: skip
    merged_model = builder.lora(str(lora_path), STRENGTH, LTXV_LORA_COMFY_RENAMING_MAP).build(
        device=torch.device("cpu"), dtype=torch.bfloat16
    )
    fused = merged_model.state_dict()
    # the worker's targets (from the checkpoint's header) are the ranks' (from the built model)
    assert transformer_targets(kw["checkpoint_path"]) == model_targets(merged_model)
    sd = load_file(kw["checkpoint_path"])
    with safe_open(kw["checkpoint_path"], framework="pt") as f:
        metadata = f.metadata()
    changed = 0
    for key in list(sd):
        name = key.removeprefix("model.diffusion_model.")
        if key != name and name in fused:
            changed += int(not torch.equal(sd[key], fused[name]))
            sd[key] = fused[name].contiguous()
    assert changed == len(lora) // 2  # exactly the LoRA's weights moved
    merged = root / "merged.safetensors"
    save_file(sd, str(merged), metadata=metadata)
    return {"lora": str(lora_path), "merged": str(merged)}


def job_lora(files) -> list[dict]:
    return [{"path": files["lora"], "strength": STRENGTH}]


def test_one_process(tiny, files, tmp_path):
    with LocalRunner(Ltx2TwoStageRunner) as local:
        local.start(**two_stage_setup(tiny))
        ctl = _LocalCtl(local)
        fresh, _, _ = render(ctl, tmp_path / "fresh.mp4", seed=3)
        with_lora, out, _ = render(ctl, tmp_path / "lora.mp4", seed=3, loras=job_lora(files))
        after, _, _ = render(ctl, tmp_path / "after.mp4", seed=3)
    assert not torch.equal(fresh, with_lora)  # the LoRA changes the video
    assert torch.equal(after, fresh)  # and leaves nothing behind
    assert out["timings_s"]["lora_swap_stage1"] >= 0 and out["timings_s"]["lora_swap_stage2"] >= 0
    assert out["timings_s"]["lora_swap_check"] > 0  # the ranks' header checks count, as host-only time
    device = sum(v for k, v in out["timings_s"].items() if k not in ("lora_swap_check", "mux"))
    assert out["gpu_busy_s"] == pytest.approx(device, abs=1e-5)  # (not device time)
    with LocalRunner(Ltx2TwoStageRunner) as local:
        local.start(**two_stage_setup(tiny, checkpoint_path=files["merged"]))
        merged, _, _ = render(_LocalCtl(local), tmp_path / "merged.mp4", seed=3)
    assert torch.equal(with_lora, merged)  # exact: see the module docstring


def test_two_ranks(tiny, files, tmp_path):
    ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=START_TIMEOUT, **two_stage_setup(tiny))
    try:
        fresh, _, _ = render(ctl, tmp_path / "fresh.mp4", seed=4)
        with_lora, _, _ = render(ctl, tmp_path / "lora.mp4", seed=4, loras=job_lora(files))
        bad = [{"path": tiny.setup_kwargs()["checkpoint_path"], "strength": 1.0}]  # not a LoRA: refused, no swap
        with pytest.raises(SymmetricRunnerError, match=r"loras\[0\]: .*not a LoRA factor"):
            list(ctl.stream(timeout=120, output_path=str(tmp_path / "x.mp4"), **{**JOB, "loras": bad}))
        after, _, _ = render(ctl, tmp_path / "after.mp4", seed=4)
    finally:
        ctl.shutdown(graceful_timeout=10)
    assert not torch.equal(fresh, with_lora) and torch.equal(after, fresh)
    merged_ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"])
    merged_ctl.start(timeout=START_TIMEOUT, **two_stage_setup(tiny, checkpoint_path=files["merged"]))
    try:
        merged, _, _ = render(merged_ctl, tmp_path / "merged.mp4", seed=4)
    finally:
        merged_ctl.shutdown(graceful_timeout=10)
    assert torch.equal(with_lora, merged)
