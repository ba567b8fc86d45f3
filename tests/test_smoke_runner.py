"""The smoke runner under the real controller: CPU fleets of 1 and 2 ranks over gloo render real mp4s with an
AAC audio track (decoded back with PyAV), world 2 matches world 1 before the encoders (latents, frames and
waveform, within what summation order can change) and each fleet's encoders reproduce its bytes, `audio=False` gives a
silent file without the audio stage, limits are symmetric recoverable errors, cancellation keeps the fleet,
and the tiny checkpoint is deterministic."""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ltx_mgpu import JobCancelledError, MGPUController, SymmetricRunnerError
from ltx_mgpu.media.mp4 import AudioTrack, write_mp4
from ltx_mgpu.media.mp4_read import probe_mp4, read_audio, read_mp4
from ltx_mgpu.runners.smoke import SmokeRunner, ensure_smoke_checkpoint

START_TIMEOUT = 180
JOB = {"prompt": "a red fox in the snow", "seed": 7, "width": 128, "height": 96, "num_frames": 17, "steps": 2}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("smoke_ckpt"))


class RecordingSmokeRunner(SmokeRunner):
    """The smoke runner that also saves, on the driver, what the encoders get: the denoised video latent and
    the uint8 frames (`<record_dir>/video.pt`), the denoised audio latent and the waveform (`audio.pt`).
    Each render overwrites them."""

    def setup(self, *, record_dir: str, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.record_dir = Path(record_dir)

    def decode_video(self, geo: Any, video_state: Any) -> torch.Tensor:
        frames = super().decode_video(geo, video_state)
        torch.save({"latent": video_state.latent.float().cpu(), "frames": frames}, self.record_dir / "video.pt")
        return frames

    def decode_audio(self, geo: Any, audio_state: Any) -> Any:
        track = super().decode_audio(geo, audio_state)
        record = {"latent": audio_state.latent.float().cpu(), "wave": track.waveform.float().cpu()}
        torch.save(record, self.record_dir / "audio.pt")
        return track


@pytest.fixture(scope="module")
def record_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return {world: tmp_path_factory.mktemp(f"record_w{world}") for world in (1, 2)}


@pytest.fixture(scope="module")
def fleets(ckpt_dir: str, record_dirs: dict[int, Path]) -> Any:
    controllers: dict[int, MGPUController] = {}
    try:
        for world in (1, 2):
            ctl = MGPUController(RecordingSmokeRunner, devices=["cpu"] * world)
            ctl.start(
                timeout=START_TIMEOUT, checkpoint_dir=ckpt_dir, max_tokens=512, record_dir=str(record_dirs[world])
            )
            controllers[world] = ctl
        yield controllers
    finally:
        for ctl in controllers.values():
            ctl.shutdown(graceful_timeout=10)


def _render(ctl: MGPUController, out: Path, **overrides: Any) -> list[dict[str, Any]]:
    return list(ctl.stream(timeout=120, output_path=str(out), **{**JOB, **overrides}))


@pytest.mark.numerics
def test_renders_mp4_with_audio_at_world_1_and_2_and_they_match(
    fleets: dict, record_dirs: dict[int, Path], tmp_path: Path
) -> None:
    video_in, audio_in = {}, {}
    for world, ctl in fleets.items():
        out = tmp_path / f"w{world}.mp4"
        events = _render(ctl, out)
        video_in[world] = torch.load(record_dirs[world] / "video.pt")
        audio_in[world] = torch.load(record_dirs[world] / "audio.pt")
        # Only the driver yields: encode, denoise, 2 x progress, decode, audio_decode, mux, output.
        assert [e["type"] for e in events] == ["stage", "stage", "progress", "progress", *["stage"] * 3, "output"]
        assert [e["stage"] for e in events if e["type"] == "stage"] == [
            "encode", "denoise", "decode", "audio_decode", "mux"
        ]  # fmt: skip
        assert [(e["step"], e["total"]) for e in events if e["type"] == "progress"] == [(1, 2), (2, 2)]
        output = events[-1]
        assert output["path"] == str(out) and output["world_size"] == world
        assert (output["frames"], output["width"], output["height"], output["fps"]) == (17, 128, 96, 24.0)
        assert output["bytes"] == out.stat().st_size > 0 and output["content_type"] == "video/mp4"
        assert output["audio"] is True and output["audio_sample_rate"] == 24000
        assert output["audio_duration_s"] == pytest.approx(17 / 24.0, abs=1 / 24000)  # fitted to the video
        assert set(output["timings_s"]) == {"encode", "denoise", "decode", "audio_decode", "mux"}
        assert all(t >= 0 for t in output["timings_s"].values())
        streams = probe_mp4(out)
        assert (streams.video_codec, streams.audio_codec) == ("h264", "aac")
        assert (streams.audio_sample_rate, streams.audio_channels) == (24000, 2)
        assert abs(streams.audio_duration_s - streams.video_duration_s) < 0.1
        decoded, fps = read_mp4(out)
        assert decoded.shape == (17, 96, 128, 3) and fps == pytest.approx(24.0)
        assert decoded.float().std() > 5  # a real picture, not a constant frame
        wave, _ = read_audio(out)
        assert torch.isfinite(wave).all() and wave.std() > 1e-3  # a real signal, not silence
        # The mp4 path on its own: x264 and AAC are deterministic for the same input and the same x264
        # thread count (auto: from the CPU count), so re-encoding what this fleet fed them gives its bytes.
        # Their output is not compared across layouts: both are lossy (crf 18 on the smoke model's
        # noise-like frames moves pixels by ~46 levels on average) and their mode decisions turn a
        # one-level input difference into tens of levels (measured: 43 between two CPU paths).
        again = tmp_path / f"again{world}.mp4"
        track = AudioTrack(audio_in[world]["wave"], 24000).fitted(17 / 24.0)
        write_mp4(video_in[world]["frames"], again, 24.0, audio=track)
        assert again.read_bytes() == out.read_bytes()
    # World 1 and 2 compute the same floats in a different summation order: SP splits every GEMM's rows
    # across the ranks, and MKL and oneDNN pick their kernels (so their order) from the matrix shape, the
    # thread count (2 threads at world 1, 1 per rank at world 2) and the CPU. fp32 sums of n terms differ
    # by ~n * 2^-24 relative; one SP forward stays within 1e-5 of one rank (test_sp_parallel), and two
    # Euler steps (|d sigma| <= 1) add at most two of those, so 1e-4 on latents of magnitude ~5 is that
    # bound with room. Measured: 0 here at every ATEN_CPU_CAPABILITY; 4.2e-6 with world 1 on `default`
    # and world 2 on `avx512`. A real SP bug (a token in the wrong place, a missed mask) moves latents by
    # O(1) (their std is ~1.4).
    for what in ("video", "audio"):
        ins = video_in if what == "video" else audio_in
        lat = (ins[1]["latent"] - ins[2]["latent"]).abs().max().item()
        assert lat <= 1e-4, f"{what} latents differ by {lat:.3g}"
    # uint8 frames are the decoder's floats rounded to 1/255 steps: a float difference of d levels (d < 1)
    # flips the rounding by one level, for a fraction ~d of the values. The decoder maps the 1e-4 latent
    # bound to well under a level (measured: 4.2e-6 in the latent flipped 0.007% of values), so at most
    # one level anywhere, and in under 1% of values; decoding garbage moves most values by many levels.
    vframes = (video_in[1]["frames"].float() - video_in[2]["frames"].float()).abs()
    flipped = (vframes > 0).float().mean().item()
    assert vframes.max() <= 1 and flipped <= 0.01, (vframes.max().item(), flipped)
    # The waveform: the vocoder's gain from the latent is ~0.1 (measured: 4.6e-7 for 4.2e-6), and its convs
    # run at 2 threads vs 1 (1.5e-7 from the thread count alone here), so 1e-4 is the latent bound through
    # that gain with room: ~3 steps of 16-bit audio, far below the signal (std ~0.03).
    wdiff = (audio_in[1]["wave"] - audio_in[2]["wave"]).abs().max().item()
    assert wdiff <= 1e-4, wdiff


def test_media_frames_hands_off_yuv_and_audio_and_encodes_to_the_same_video(fleets: dict, tmp_path: Path) -> None:
    """`media="frames"` (the worker's path): no mux stage and no file; a `media` event carries
    yuv420p frames and the waveform through the controller's tensor path, and encoding them beside the fleet
    gives the very video the fleet's own mp4 path writes. The output event carries the device-busy clock."""
    from ltx_mgpu.media.mp4 import AudioTrack, EncodeOptions, write_mp4_yuv

    ctl = fleets[2]
    on_fleet = tmp_path / "fleet.mp4"
    _render(ctl, on_fleet)
    out = tmp_path / "never.mp4"
    events = _render(ctl, out, media="frames")
    assert not out.exists()
    assert [e["stage"] for e in events if e["type"] == "stage"] == ["encode", "denoise", "decode", "audio_decode"]
    (media,) = [e for e in events if e["type"] == "media"]
    output = events[-1]
    assert output["type"] == "output" and output["media"] == "frames" and output["bytes"] == 0
    assert set(output["timings_s"]) == {"encode", "denoise", "decode", "audio_decode", "handoff"}
    assert output["gpu_busy_s"] == pytest.approx(sum(output["timings_s"].values()), abs=1e-5)
    assert output["gpu_started_at"] <= output["gpu_ended_at"]
    yuv = media["video"]
    assert yuv.dtype == torch.uint8 and tuple(yuv.shape) == (17, 96 * 3 // 2, 128) and yuv.is_shared()
    assert (media["width"], media["height"], media["fps"], media["audio_sample_rate"]) == (128, 96, 24.0, 24000)
    track = AudioTrack(media["audio"], media["audio_sample_rate"])
    beside = tmp_path / "beside.mp4"
    write_mp4_yuv(yuv, beside, media["fps"], width=media["width"], audio=track, options=EncodeOptions(crf=18))
    assert torch.equal(read_mp4(beside)[0], read_mp4(on_fleet)[0])
    assert torch.equal(read_audio(beside)[0], read_audio(on_fleet)[0])


def test_one_step_renders_finite_video_and_audio(fleets: dict, tmp_path: Path) -> None:
    """ltx-core's scheduler starts a 1-step schedule with NaN: the render was garbage and its audio made the
    AAC encoder fail (seen in the chaos suite); one step is the plain [1, 0] schedule."""
    out = tmp_path / "one.mp4"
    output = _render(fleets[2], out, steps=1)[-1]
    assert output["type"] == "output" and output["audio"] is True
    decoded, _ = read_mp4(out)
    wave, _ = read_audio(out)
    assert decoded.float().std() > 5 and torch.isfinite(wave).all() and wave.std() > 1e-3


def test_non_finite_latents_are_a_symmetric_error() -> None:
    from ltx_mgpu.control.errors import RunnerError
    from ltx_mgpu.runners.common.stages import check_finite

    check_finite(video=torch.zeros(2), audio=torch.ones(2))
    with pytest.raises(RunnerError, match="denoised audio latent is not finite"):
        check_finite(video=torch.zeros(2), audio=torch.tensor([0.0, float("nan")]))


def test_audio_false_writes_a_silent_mp4_and_skips_the_decode(fleets: dict, tmp_path: Path) -> None:
    out = tmp_path / "silent.mp4"
    events = _render(fleets[2], out, audio=False)
    assert "audio_decode" not in [e["stage"] for e in events if e["type"] == "stage"]
    output = events[-1]
    assert output["audio"] is False and output["audio_sample_rate"] is None and output["audio_duration_s"] is None
    assert "audio_decode" not in output["timings_s"]
    assert probe_mp4(out).audio_codec is None
    with pytest.raises(SymmetricRunnerError, match="audio must be true or false"):
        _render(fleets[2], tmp_path / "x.mp4", audio="false")


def test_same_seed_same_frames_other_seed_differs(fleets: dict, tmp_path: Path) -> None:
    ctl = fleets[1]
    a, b, c = (tmp_path / n for n in ("a.mp4", "b.mp4", "c.mp4"))
    _render(ctl, a)
    _render(ctl, b)
    _render(ctl, c, seed=8)
    fa, fb, fc = (read_mp4(p)[0].float() for p in (a, b, c))
    assert torch.equal(fa, fb)  # one fleet: the same kernels, thread counts and summation order each time
    assert (fa - fc).abs().mean() > 5


def test_guidance_runs_a_batch_of_two_through_sp(fleets: dict, tmp_path: Path) -> None:
    plain, guided = tmp_path / "plain.mp4", tmp_path / "guided.mp4"
    _render(fleets[2], plain)
    events = _render(fleets[2], guided, guidance_scale=4.0, negative_prompt="blurry")
    assert events[-1]["type"] == "output"
    assert (read_mp4(plain)[0].float() - read_mp4(guided)[0].float()).abs().mean() > 1


def test_over_max_tokens_is_symmetric_and_the_fleet_serves_the_next_job(fleets: dict, tmp_path: Path) -> None:
    ctl = fleets[2]
    with pytest.raises(SymmetricRunnerError) as err:
        _render(ctl, tmp_path / "big.mp4", width=1024, height=1024)  # 3 x 32 x 32 = 3072 tokens > 512
    assert len(err.value.errors) == 2  # every rank raised it, before any collective
    assert str(err.value) == (
        "Total video token count (3072) exceeds attention_manager max_tokens (512). "
        "Use a smaller resolution or fewer frames."
    )
    assert not (tmp_path / "big.mp4").exists()
    assert ctl.is_alive
    assert _render(ctl, tmp_path / "next.mp4")[-1]["type"] == "output"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"width": 100}, "width and height must be positive multiples of 32"),
        ({"num_frames": 10}, "num_frames must be 8k+1"),
        ({"steps": 51}, "steps must be in [1, 50]"),
        ({"guidance_scale": 0.5}, "guidance_scale must be in [1, 20], got 0.5"),
        # a security review: these killed the rank (OverflowError; a 115 GB allocation) on every attempt
        ({"frame_rate": 1e-300}, "frame_rate must be in [1, 120], got 1e-300"),
        ({"frame_rate": 1e-6}, "frame_rate must be in [1, 120], got 1e-06"),
        ({"frame_rate": float("nan")}, "frame_rate must be finite, got nan"),
        ({"frame_rate": True}, "frame_rate must be a number, got bool"),
        ({"seed": 10**5000}, "seed must be in [0, 4294967295], got an integer of 5001 digits"),
        (
            {"num_frames": 257, "frame_rate": 1.0},
            "the audio track (257 frames at 1 fps = 257.0 s, 6425 audio "
            "latents) exceeds the runner's token budget (512)",
        ),
    ],
)
def test_invalid_requests_are_recoverable(fleets: dict, tmp_path: Path, overrides: dict, message: str) -> None:
    ctl = fleets[2]
    with pytest.raises(SymmetricRunnerError, match=re.escape(message)):
        _render(ctl, tmp_path / "bad.mp4", **overrides)
    assert ctl.is_alive


def test_cancel_mid_render_keeps_the_fleet(fleets: dict, tmp_path: Path) -> None:
    ctl = fleets[2]
    stream = ctl.stream(timeout=120, output_path=str(tmp_path / "cancelled.mp4"), **{**JOB, "steps": 20})
    seen = []
    with pytest.raises(JobCancelledError):
        for event in stream:
            seen.append(event)
            if event["type"] == "progress":
                stream.cancel()
    steps_done = [e["step"] for e in seen if e["type"] == "progress"]
    assert 1 <= len(steps_done) < 20
    assert not (tmp_path / "cancelled.mp4").exists()
    assert _render(ctl, tmp_path / "after.mp4")[-1]["type"] == "output"


def test_enhance_prompt_is_accepted_and_ignored(fleets: dict, tmp_path: Path) -> None:
    a, b = tmp_path / "e0.mp4", tmp_path / "e1.mp4"
    _render(fleets[1], a)
    _render(fleets[1], b, enhance_prompt=True, frame_rate=24.0)
    assert torch.equal(read_mp4(a)[0], read_mp4(b)[0])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoint_is_deterministic_and_safe_to_create_concurrently(tmp_path: Path) -> None:
    first = ensure_smoke_checkpoint(tmp_path / "one")
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_smoke_checkpoint(tmp_path / "two"))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for other in results:
        assert _sha(other.transformer_path) == _sha(first.transformer_path)
        assert _sha(other.decoder_path) == _sha(first.decoder_path)
        assert _sha(other.audio_path) == _sha(first.audio_path)
    leftovers = [p.name for p in results[0].directory.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # temporary files were renamed or removed
