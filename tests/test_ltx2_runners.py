"""The LTX-2 runners end to end on tiny checkpoints in the released layouts (monolith transformer + VAE +
text projection, x2 upsampler, distilled LoRA, Gemma root with a locally built tokenizer), through the real
loaders: on 2 CPU ranks under `MGPUController` and on one process (`LocalRunner`).

What is checked: a valid mp4 (decodable, right size, frame count and rate, an AAC stereo track as long as
the video within 0.1 s, per-stage timings in the output event) from each runner; `audio=False` (a silent
file, no audio stage); one process and two ranks give the same audio; determinism
across jobs (the two-stage runner swaps the distilled LoRA in and out every job, so a repeat equals the
first only if the tracker restores the exact clean weights); single process vs 2 ranks; symmetric request
errors that leave the fleet alive; image conditioning, prompt enhancement and fp8 quantization passed
through (a bad quantization name fails setup loudly).
"""

from __future__ import annotations

import base64
import io
import logging

import pytest
import torch

from ltx_mgpu import MGPUController, SymmetricRunnerError
from ltx_mgpu.media.mp4_read import probe_mp4, read_audio, read_mp4
from ltx_mgpu.runners.common.local import LocalRunner
from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner

START_TIMEOUT = 300
JOB = {"prompt": "a cat walks along the beach", "width": 128, "height": 128, "num_frames": 9, "frame_rate": 8.0}
SETUP = {"prompt_tokens": 128, "default_steps": 2, "enhance_max_new_tokens": 6, "tdp_overlap": 1}


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


def distilled_setup(tiny, **extra):
    kw = tiny.setup_kwargs()
    kw.pop("distilled_lora_path")
    return {**kw, **SETUP, **extra}


def two_stage_setup(tiny, **extra):
    return {**tiny.setup_kwargs(), **SETUP, **extra}


def png_b64(height: int = 40, width: int = 48) -> str:
    import av
    import numpy as np

    xs, ys = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    img = np.stack([xs, ys, np.full((height, width), 90.0)], axis=-1).astype("uint8")
    buf = io.BytesIO()
    with av.open(buf, "w", format="image2pipe") as c:
        s = c.add_stream("png", rate=1)
        s.width, s.height, s.pix_fmt = width, height, "rgb24"
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return base64.b64encode(buf.getvalue()).decode()


def render(ctl, path, **job):
    events = list(ctl.stream(timeout=300, output_path=str(path), **{**JOB, **job}))
    outputs = [e for e in events if isinstance(e, dict) and e.get("type") == "output"]
    assert len(outputs) == 1, events
    frames, fps = read_mp4(path)
    assert frames.shape == (JOB["num_frames"], job.get("height", 128), job.get("width", 128), 3)
    assert fps == pytest.approx(JOB["frame_rate"])
    assert frames.float().std() > 1.0  # not a blank video
    out = outputs[0]
    stages = [e["stage"] for e in events if isinstance(e, dict) and e.get("type") == "stage"]
    swaps = {k for k in out["timings_s"] if k.startswith("lora_swap_")}  # timed, not announced as stages
    parked = {"unpark"} if (job.get("memory_plan") or {}).get("park_text_encoder") else set()  # timed too
    assert set(out["timings_s"]) - swaps - parked == set(stages) and out["synthetic_weights"] is True
    assert parked <= set(out["timings_s"])
    # a request's LoRAs: their header checks on the ranks are part of the job's swap cost, timed
    assert ("lora_swap_check" in swaps) == bool(job.get("loras"))
    expected = {"lora_swap_stage1", "lora_swap_stage2"} if "tdp" in str(events) else set()
    assert swaps - {"lora_swap_check"} == expected
    if job.get("audio", True):
        streams = probe_mp4(path)
        assert (streams.audio_codec, streams.audio_sample_rate, streams.audio_channels) == ("aac", 24000, 2)
        assert abs(streams.audio_duration_s - streams.video_duration_s) < 0.1
        assert out["audio"] is True and out["audio_sample_rate"] == 24000
        assert out["audio_duration_s"] == pytest.approx(JOB["num_frames"] / JOB["frame_rate"], abs=1e-4)
    return frames, out, events


class _LocalCtl:
    """`render()` wants `ctl.stream(timeout=..., **job)`."""

    def __init__(self, local: LocalRunner) -> None:
        self.local = local

    def stream(self, timeout=None, **job):
        del timeout
        return self.local.stream(**job)


# ---- 2 CPU ranks under the controller ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_stage_fleet(tiny):
    ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=START_TIMEOUT, **two_stage_setup(tiny))
    yield ctl
    ctl.shutdown(graceful_timeout=10)


@pytest.fixture(scope="module")
def distilled_fleet(tiny):
    ctl = MGPUController(Ltx2DistilledRunner, devices=["cpu", "cpu"])
    # One VAE tile: the comparison with one process below then isolates SP (the two-stage fleet covers the
    # distributed decode with two tiles).
    ctl.start(timeout=START_TIMEOUT, **distilled_setup(tiny, dtype="float32", vae_tiles=1))
    yield ctl
    ctl.shutdown(graceful_timeout=10)


def test_two_stage_renders_and_repeats_exactly(two_stage_fleet, tmp_path):
    first, out, events = render(two_stage_fleet, tmp_path / "a.mp4", seed=3)
    stages = [e["stage"] for e in events if isinstance(e, dict) and e.get("type") == "stage"]
    assert stages == ["encode", "stage1", "upsample", "stage2", "decode", "audio_decode", "mux"]
    assert next(e for e in events if e.get("stage") == "stage2" and e["type"] == "stage")["mode"] == "tdp"
    # the reference's stage-1 guidance: conditional, negative, STG-perturbed, modality-isolated passes
    assert next(e for e in events if e.get("stage") == "stage1" and e["type"] == "stage")["passes"] == 4
    assert out["world_size"] == 2 and out["width"] == 128
    again, _, _ = render(two_stage_fleet, tmp_path / "b.mp4", seed=3)
    assert torch.equal(first, again)  # LoRA reset + re-apply restored the exact weights in between
    other, _, _ = render(two_stage_fleet, tmp_path / "c.mp4", seed=4, negative_prompt="dark", guidance_scale=2.0)
    assert not torch.equal(first, other)


def test_two_stage_image_conditioning_and_enhancement(two_stage_fleet, tmp_path):
    images = [{"data": png_b64(), "frame": 0, "strength": 1.0}, {"data": png_b64(30, 30), "frame": 8, "strength": 0.8}]
    plain, _, _ = render(two_stage_fleet, tmp_path / "p.mp4", steps=2)
    conditioned, _, _ = render(two_stage_fleet, tmp_path / "i.mp4", images=images, steps=2)
    assert not torch.equal(plain, conditioned)
    _, out, _ = render(two_stage_fleet, tmp_path / "e.mp4", enhance_prompt=True, steps=2)
    assert out["prompt"] != JOB["prompt"]  # rewritten by the (tiny) Gemma on rank 0, broadcast to rank 1
    try:  # image-conditioned enhancement needs pillow + torchvision for Gemma's image processor
        import PIL  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(SymmetricRunnerError, match="needs the Gemma image processor"):
            render(two_stage_fleet, tmp_path / "x.mp4", images=images[:1], enhance_prompt=True, steps=2)
    else:
        render(two_stage_fleet, tmp_path / "x.mp4", images=images[:1], enhance_prompt=True, steps=2)


def test_request_errors_are_symmetric_and_the_fleet_survives(two_stage_fleet, distilled_fleet, tmp_path):
    cases = [
        (two_stage_fleet, {"width": 96}, "multiples of 64"),
        (two_stage_fleet, {"num_frames": 10}, "8k\\+1"),
        (two_stage_fleet, {"steps": 1}, "steps must be in \\[2, "),
        (two_stage_fleet, {"images": [{"data": "!!!"}]}, "base64"),
        (two_stage_fleet, {"images": [{"data": base64.b64encode(b"nope").decode()}]}, "not a PNG, JPEG, WebP"),
        (distilled_fleet, {"steps": 4}, "fixed schedule"),
        (distilled_fleet, {"negative_prompt": "ugly"}, "no negative prompt"),
        (distilled_fleet, {"width": 3840, "height": 3840, "num_frames": 9}, "14745600 pixels a frame"),
        (distilled_fleet, {"width": 128 * 64}, "width must be in \\[32, 3840\\], got 8192"),
        (distilled_fleet, {"frame_rate": 1e-300}, "frame_rate must be in \\[1, 120\\], got 1e-300"),
    ]
    ruled = ("multiples of 64", "8k\\+1", "steps must be in", "fixed schedule", "no negative prompt", "pixels a frame")
    for ctl, job, message in cases:
        with pytest.raises(SymmetricRunnerError, match=message) as refused:
            list(ctl.stream(timeout=120, output_path=str(tmp_path / "x.mp4"), **{**JOB, **job}))
        # the request rules' refusals are the client's (invalid_request), the rest the runner's (runner_error)
        assert (refused.value.request_refused is not None) == any(r in message for r in ruled), message
    render(distilled_fleet, tmp_path / "ok.mp4")  # still alive


@pytest.mark.numerics
def test_distilled_one_process_matches_two_ranks(distilled_fleet, tiny, tmp_path):
    two, _, events = render(distilled_fleet, tmp_path / "two.mp4", seed=9)
    assert next(e for e in events if e.get("stage") == "stage2" and e["type"] == "stage")["mode"] == "sp"
    with LocalRunner(Ltx2DistilledRunner) as local:
        local.start(**distilled_setup(tiny, dtype="float32", vae_tiles=1))
        one, _, _ = render(_LocalCtl(local), tmp_path / "one.mp4", seed=9)
    # SP is faithful up to floating-point reduction order (float32 here): after 11 steps, decoding and H.264
    # the videos agree to within a fraction of an 8-bit level on average. A mean, not a max: x264 turns a
    # one-level input difference into tens of levels in a few places (measured on the smoke model: max 43,
    # mean 0.06 between two CPU paths); 0.5 is ~8x that mean, and a wrong token order moves it by tens.
    diff = (two.float() - one.float()).abs()
    assert diff.mean().item() < 0.5, diff.mean().item()
    # Audio tokens are computed whole on every rank (SP splits video tokens only), but they attend to the video,
    # so the reduction-order differences reach them too: the same track up to a small relative error.
    a2, a1 = read_audio(tmp_path / "two.mp4")[0], read_audio(tmp_path / "one.mp4")[0]
    rel = ((a1 - a2).norm() / a1.norm()).item()
    assert a1.shape == a2.shape and rel < 0.05, rel


def test_audio_false_is_a_silent_file_without_the_audio_stage(distilled_fleet, tmp_path):
    _, out, events = render(distilled_fleet, tmp_path / "silent.mp4", audio=False)
    assert "audio_decode" not in [e["stage"] for e in events if e.get("type") == "stage"]
    assert out["audio"] is False and "audio_decode" not in out["timings_s"]
    assert probe_mp4(tmp_path / "silent.mp4").audio_codec is None


# ---- one process ------------------------------------------------------------------------------------------
def test_a_streamed_text_encoder_renders_the_same_video(tiny, tmp_path):
    """The `stream` placement changes where Gemma's layers live, not a number: the same frames as the resident
    encoder (one process, the same seed), and every job's encode streams each layer in once; prompt enhancement,
    a forward per generated token, is refused up front."""
    videos = {}
    for tier in ("gpu", "stream"):
        with LocalRunner(Ltx2DistilledRunner) as local:
            local.start(**distilled_setup(tiny, placement={"text_encoder": tier}))
            videos[tier], _, _ = render(_LocalCtl(local), tmp_path / f"{tier}.mp4", seed=4)
            streamed = local.runner.text.encoder.streamed
            assert (streamed is not None) == (tier == "stream")
            if streamed is not None:
                assert streamed.stats["forwards"] == 1 and streamed.describe()["on_device"] == 0
                # enhancement would stream every layer once per generated token: refused before any work
                with pytest.raises(ValueError, match="enhance_prompt is not available on this fleet"):
                    list(local.stream(output_path=str(tmp_path / "e.mp4"), **{**JOB, "enhance_prompt": True}))
                assert streamed.stats["forwards"] == 1
    assert torch.equal(videos["gpu"], videos["stream"])


def test_a_job_without_conditioning_gives_the_transformer_one_timestep_per_row(tiny, tmp_path):
    """Without conditioning items every token has the same timestep: the transformer embeds one per row (its
    AdaLN embedding sees the batch rows, not rows x tokens) and every block broadcasts it; an image-conditioned
    job keeps its per-token timesteps (the conditioned tokens are denoised less). tests/test_sp_parallel.py
    holds the numbers: the same as the per-token forward up to fp32 summation order."""
    seen: list[int] = []
    with LocalRunner(Ltx2DistilledRunner) as local:
        local.start(**distilled_setup(tiny))
        adaln = local.runner.sp_model.model.adaln_single
        hook = adaln.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].numel())))
        try:
            render(_LocalCtl(local), tmp_path / "plain.mp4", seed=3)
            plain = list(seen)
            seen.clear()
            images = [{"data": png_b64(), "frame": 0, "strength": 1.0}]
            render(_LocalCtl(local), tmp_path / "image.mp4", seed=3, images=images)
        finally:
            hook.remove()
    assert plain and set(plain) == {1}, plain  # one row (the distilled runner's single pass), one timestep
    assert seen and min(seen) > 1, seen  # per token: the first latent frame's tokens are the image's


def test_two_stage_single_process_with_fp8_quantization(tiny, tmp_path, caplog):
    with LocalRunner(Ltx2TwoStageRunner) as local:
        with caplog.at_level(logging.WARNING, logger="ltx_mgpu.runners"):
            local.start(**two_stage_setup(tiny, quantization="fp8-cast"))
        said = [r for r in caplog.records if "renders from synthetic weights are noise" in r.getMessage()]
        assert len(said) == 1  # once per setup: the tiny files are synthetic
        weights = {p.dtype for p in local.runner.sp_model.model.parameters()}
        assert torch.float8_e4m3fn in weights  # the policy reached the loader
        render(_LocalCtl(local), tmp_path / "q.mp4")


def test_two_stage_cfg_only_guidance_runs_two_passes_a_step(tiny, tmp_path):
    """SGLang's published LTX-2 two-stage figure is plain CFG (2 passes a step); `stage1_guidance` sets it."""
    cfg_only = {m: {"cfg_scale": 4.0, "stg_scale": 0.0, "rescale_scale": 0.0, "modality_scale": 1.0}
                for m in ("video", "audio")}  # fmt: skip
    with LocalRunner(Ltx2TwoStageRunner) as local:
        local.start(**two_stage_setup(tiny, stage1_guidance=cfg_only))
        _, _, events = render(_LocalCtl(local), tmp_path / "cfg.mp4", steps=2)
    assert next(e for e in events if e.get("stage") == "stage1" and e["type"] == "stage")["passes"] == 2
    with LocalRunner(Ltx2TwoStageRunner) as local, pytest.raises(ValueError, match="unknown fields"):
        local.start(**two_stage_setup(tiny, stage1_guidance={"video": {"cfg": 4.0}}))
    with LocalRunner(Ltx2TwoStageRunner) as local, pytest.raises(ValueError, match="'video' and/or 'audio'"):
        local.start(**two_stage_setup(tiny, stage1_guidance={"text": {}}))


def test_bad_setup_fails_loudly(tiny):
    with LocalRunner(Ltx2TwoStageRunner) as local, pytest.raises(ValueError, match="unknown quantization"):
        local.start(**two_stage_setup(tiny, quantization="int3"))
    with LocalRunner(Ltx2TwoStageRunner) as local, pytest.raises(ValueError, match="distilled_lora_path"):
        local.start(**two_stage_setup(tiny, distilled_lora_path=None))
    with LocalRunner(Ltx2DistilledRunner) as local, pytest.raises(FileNotFoundError, match="spatial upsampler"):
        local.start(**distilled_setup(tiny, spatial_upsampler_path="/nonexistent.safetensors"))


def test_truncated_checkpoint_is_refused(tiny, tmp_path):
    """ltx-core returns a model still on meta when keys are missing; the runners refuse it by name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cut = tmp_path / "cut.safetensors"
    with safe_open(str(tiny.checkpoint), framework="pt") as f:
        meta = f.metadata()
        save_file({k: f.get_tensor(k) for k in f.keys() if "proj_out" not in k}, str(cut), metadata=meta)
    with LocalRunner(Ltx2DistilledRunner) as local, pytest.raises(RuntimeError, match="meta device"):
        local.start(**distilled_setup(tiny, checkpoint_path=str(cut)))
