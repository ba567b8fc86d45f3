"""Audio in the mp4 and audio decoding without torchaudio.

- `write_mp4` with a 440 Hz stereo sine at 24 kHz: PyAV reopens one H.264 and one AAC stream (24000 Hz, 2
  channels), the decoded samples match the input's length within AAC's frame padding, the spectrum peaks at
  440 Hz in both channels (the right one at half the level), and a mono track becomes stereo.
- ltx-core's audio decoder and vocoder import and decode to finite samples with torchaudio blocked
  (`sys.modules["torchaudio"] = None`) and with a broken torchaudio on the path (the CUDA-wheel failure mode:
  `OSError` at import), in fresh subprocesses; afterwards no stand-in is left in `sys.modules`, and the audio
  encoder's path says clearly why it cannot work. Where a real torchaudio imports, it is the one used.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ltx_mgpu.media.mp4 import AudioTrack, write_mp4
from ltx_mgpu.media.mp4_read import probe_mp4, read_audio

RATE = 24000
AAC_FRAME = 1024


def _sine(seconds: float, hz: float = 440.0) -> torch.Tensor:
    t = torch.arange(round(seconds * RATE), dtype=torch.float64) / RATE
    left = 0.5 * torch.sin(2 * math.pi * hz * t)
    return torch.stack([left, 0.5 * left]).float()


def _peak_hz(channel: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(channel * np.hanning(len(channel))))
    return float(np.argmax(spectrum)) * RATE / len(channel)


def test_write_mp4_muxes_aac_stereo_at_the_vocoder_rate(tmp_path: Path) -> None:
    wave = _sine(2.0)
    frames = torch.randint(0, 256, (17, 64, 96, 3), dtype=torch.uint8)
    path = tmp_path / "sine.mp4"
    size = write_mp4(frames, path, 8.0, audio=AudioTrack(wave, RATE))
    assert size == path.stat().st_size
    streams = probe_mp4(path)
    assert (streams.video_codec, streams.frames, streams.fps) == ("h264", 17, 8.0)
    assert (streams.audio_codec, streams.audio_sample_rate, streams.audio_channels) == ("aac", RATE, 2)
    decoded, rate = read_audio(path)
    assert rate == RATE and decoded.shape[0] == 2
    # The edit list removes the encoder's priming; what remains is the input padded to whole AAC frames.
    assert wave.shape[1] <= decoded.shape[1] < wave.shape[1] + AAC_FRAME
    body = decoded[:, AAC_FRAME : wave.shape[1] - AAC_FRAME].numpy()
    assert _peak_hz(body[0]) == pytest.approx(440.0, abs=1.0)
    assert _peak_hz(body[1]) == pytest.approx(440.0, abs=1.0)
    level = np.sqrt((body**2).mean(axis=1))
    assert level[0] == pytest.approx(0.5 / math.sqrt(2), rel=0.05) and level[1] / level[0] == pytest.approx(
        0.5, rel=0.05
    )
    # without audio: one video stream only
    silent = tmp_path / "silent.mp4"
    write_mp4(frames, silent, 8.0)
    assert probe_mp4(silent).audio_codec is None


def test_mono_becomes_stereo_and_tracks_fit_the_video(tmp_path: Path) -> None:
    mono = AudioTrack(_sine(1.0)[:1], RATE)
    path = tmp_path / "mono.mp4"
    write_mp4(torch.zeros((9, 32, 32, 3), dtype=torch.uint8), path, 8.0, audio=mono)
    assert probe_mp4(path).audio_channels == 2
    assert mono.fitted(1.5).waveform.shape == (1, int(1.5 * RATE))  # padded with silence
    assert mono.fitted(1.5).waveform[:, RATE:].abs().max() == 0
    assert mono.fitted(0.25).waveform.shape == (1, RATE // 4)  # trimmed
    with pytest.raises(ValueError, match="audio waveform"):
        AudioTrack(torch.zeros(3, 10), RATE)


# ---- decoding without torchaudio (fresh interpreters: the import state is the thing under test) ----------
_DECODE = textwrap.dedent(
    """
    import sys, torch
    {block}
    from ltx_mgpu.runners.common.audio import build_audio_decoding
    from ltx_mgpu.runners.smoke.checkpoint import write_audio_checkpoint
    path = write_audio_checkpoint(sys.argv[1] + "/audio.safetensors")
    audio = build_audio_decoding(str(path), torch.device("cpu"), torch.float32)
    track = audio.decode(torch.randn(1, 8, 25, 16))
    ops = sys.modules["ltx_core.model.audio_vae.ops"]
    assert track.sample_rate == 24000 and track.waveform.shape == (2, 97 * 240), track.waveform.shape
    assert bool(torch.isfinite(track.waveform).all()) and float(track.waveform.std()) > 0
    left = sys.modules.get("torchaudio", "absent")
    print("TORCHAUDIO_AFTER", "absent" if left == "absent" else ("None" if left is None else type(left).__name__))
    try:
        ops.AudioProcessor(16000, 64, 160, 1024)
    except ImportError as exc:
        print("ENCODER", "ImportError:", exc)
    else:
        print("ENCODER", "works")
    """
)


def _run(tmp_path: Path, block: str, env: dict[str, str] | None = None) -> str:
    script = _DECODE.format(block=block)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_decodes_with_torchaudio_blocked(tmp_path: Path) -> None:
    out = _run(tmp_path, 'sys.modules["torchaudio"] = None')
    assert "TORCHAUDIO_AFTER None" in out  # the caller's block is back, our stand-in is gone
    assert "ENCODER ImportError:" in out and "audio encoder does not" in out


def test_decodes_with_a_broken_torchaudio_on_the_path(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "torchaudio"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise OSError("libc10_cuda.so: cannot open shared object file")\n')
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    out = _run(tmp_path, "", env={"PYTHONPATH": path})
    assert "TORCHAUDIO_AFTER absent" in out
    assert "ENCODER ImportError:" in out and "libc10_cuda.so" in out


def test_a_working_torchaudio_is_the_one_used(tmp_path: Path) -> None:
    try:
        import torchaudio  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(f"no working torchaudio here ({type(exc).__name__}); the GPU host has one")
    out = _run(tmp_path, "")
    assert "TORCHAUDIO_AFTER module" in out and "ENCODER works" in out
