"""The smoke runner on CUDA under the real controller: one rank, and two ranks oversubscribed on one GPU
(gloo), each mp4 with its AAC track (decoded on the GPU; world 2's audio equals world 1's within float noise).
Skipped cleanly without CUDA. Run on the GPU machine:

    pytest -m gpu tests/test_smoke_runner_gpu.py -v
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ltx_mgpu import MGPUController, SymmetricRunnerError
from ltx_mgpu.media.mp4_read import probe_mp4, read_audio, read_mp4
from ltx_mgpu.runners.smoke import SmokeRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

JOB = {"prompt": "a red fox in the snow", "seed": 7, "width": 256, "height": 160, "num_frames": 25, "steps": 3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smoke_render_on_one_gpu_world_1_and_2(tmp_path: Path, dtype: str) -> None:
    frames, audio = {}, {}
    for world in (1, 2):
        ctl = MGPUController(SmokeRunner, devices=[0] * world, allow_shared_devices=world > 1)
        try:
            # crf=0: lossless H.264, so the comparison below sees the frames, not codec decisions
            ctl.start(timeout=300, checkpoint_dir=str(tmp_path / "ckpt"), dtype=dtype, max_tokens=1024, crf=0)
            out = tmp_path / f"w{world}_{dtype}.mp4"
            events = list(ctl.stream(timeout=300, output_path=str(out), **JOB))
            assert events[-1]["type"] == "output" and events[-1]["world_size"] == world
            decoded, fps = read_mp4(out)
            assert decoded.shape == (25, 160, 256, 3) and fps == pytest.approx(24.0)
            frames[world] = decoded.float()
            streams = probe_mp4(out)
            assert (streams.audio_codec, streams.audio_sample_rate, streams.audio_channels) == ("aac", 24000, 2)
            assert abs(streams.audio_duration_s - streams.video_duration_s) < 0.1
            audio[world] = read_audio(out)[0]
            with pytest.raises(SymmetricRunnerError, match="Use a smaller resolution or fewer frames."):
                list(ctl.stream(timeout=300, output_path=str(tmp_path / "big.mp4"), **{**JOB, "width": 2048}))
            assert ctl.is_alive
        finally:
            ctl.shutdown(graceful_timeout=30)
    diff = (frames[1] - frames[2]).abs()
    limit = 8 if dtype == "float32" else 48  # bf16 rounding differs with the row split; still the same video
    assert diff.mean() <= (0.5 if dtype == "float32" else 4.0) and diff.max() <= limit, (diff.mean(), diff.max())
    # The audio is compared after AAC, which is lossy: on the random-weight vocoder's noise-like signal, the
    # last-bit differences of the GPU reductions (world 2 attends over gathered video keys) flip quantisation
    # decisions, a few per cent of the decoded signal (0.049 measured in float32 on an H200). A wrong audio
    # path (another latent, a dropped channel, silence) is ~1.0 or more.
    rel = ((audio[1] - audio[2]).norm() / audio[1].norm()).item()
    assert audio[1].shape == audio[2].shape and rel < 0.15, rel


def test_media_frames_hand_off_from_the_gpu_matches_the_fleets_own_mp4(tmp_path: Path) -> None:
    """`media="frames"` on CUDA: yuv420p made on the device and copied once into shared memory; encoded
    beside the fleet it is the video the fleet's own mp4 path writes (both lossless here)."""
    from ltx_mgpu.media.mp4 import AudioTrack, EncodeOptions, write_mp4_yuv

    ctl = MGPUController(SmokeRunner, devices=[0])
    try:
        ctl.start(timeout=300, checkpoint_dir=str(tmp_path / "ckpt"), max_tokens=1024, crf=0)
        on_fleet = tmp_path / "fleet.mp4"
        list(ctl.stream(timeout=300, output_path=str(on_fleet), **JOB))
        events = list(ctl.stream(timeout=300, output_path=str(tmp_path / "never.mp4"), media="frames", **JOB))
    finally:
        ctl.shutdown(graceful_timeout=30)
    (media,) = [e for e in events if e["type"] == "media"]
    output = events[-1]
    assert output["timings_s"]["handoff"] > 0 and output["gpu_started_at"] < output["gpu_ended_at"]
    yuv = media["video"]
    assert yuv.device.type == "cpu" and yuv.is_shared() and tuple(yuv.shape) == (25, 240, 256)
    beside = tmp_path / "beside.mp4"
    track = AudioTrack(media["audio"], media["audio_sample_rate"])
    write_mp4_yuv(yuv, beside, media["fps"], width=media["width"], audio=track, options=EncodeOptions(crf=0))
    assert torch.equal(read_mp4(beside)[0], read_mp4(on_fleet)[0])
