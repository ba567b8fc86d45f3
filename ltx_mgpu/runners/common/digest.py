"""What a render produced, hashed: sha256 of the frames as the encoder takes them and of the audio as the fleet
handed it off, beside the mp4's own sha256, so two renders can be compared part by part (an mp4 that differs
with equal frames and audio points at the encode; equal mp4s need equal frames and audio).

`MediaDigest(video, audio)` hashes in a thread of its own from construction, beside the x264 runs (hashlib
releases the GIL on large buffers: about 0.2 s of one core for 1536x1024x121 frames, under the encode's
seconds, and never on the fleet's side); `result()` waits for it. The exact bytes each hash covers:

- `frames_sha256` (`FRAMES_LAYOUT`): the yuv420p frames (F, H * 3 // 2, W) uint8, C-contiguous: per frame the
  Y plane (H rows of W), then U and V (H/2 x W/2 each), frame after frame (`media.rgb_to_yuv420p`);
- `audio_sha256` (`AUDIO_LAYOUT`): the waveform (channels, samples) as float32 little-endian, C-contiguous
  (channel after channel), at the vocoder's rate, before the encoder's clamp and fitting; None without audio.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import torch

__all__ = ["AUDIO_LAYOUT", "FRAMES_LAYOUT", "MediaDigest", "sha256_of"]

FRAMES_LAYOUT = "yuv420p-uint8-FHW"
AUDIO_LAYOUT = "float32le-CS"
_CHUNK = 16 << 20  #: bytes per hashlib update (large: hashlib hashes them without the GIL)


def sha256_of(array: np.ndarray) -> str:
    """Hex sha256 of an array's bytes in C order, streamed in chunks."""
    digest = hashlib.sha256()
    flat = memoryview(np.ascontiguousarray(array)).cast("B")
    for start in range(0, len(flat), _CHUNK):
        digest.update(flat[start : start + _CHUNK])
    return digest.hexdigest()


class MediaDigest:
    """sha256 of one render's frames and audio, computed in a thread; see the module docstring. The buffers
    must not change meanwhile (the encoder's hand-off buffers do not: they are final once handed over)."""

    def __init__(self, video: torch.Tensor | None, audio: torch.Tensor | None) -> None:
        self._video, self._audio = video, audio
        self._result: dict[str, str | None] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ltx-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            frames = None
            if self._video is not None:
                if self._video.dtype != torch.uint8:
                    raise ValueError(f"frames to hash must be uint8, got {self._video.dtype}")
                frames = sha256_of(self._video.detach().cpu().contiguous().numpy())
            audio = None
            if self._audio is not None:
                wave = self._audio.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
                audio = sha256_of(wave.astype("<f4", copy=False))
            self._result = {"frames_sha256": frames, "audio_sha256": audio}
        except BaseException as exc:  # (raised again in the caller's thread by result())
            self._error = exc
        finally:
            self._video = self._audio = None

    def result(self) -> dict[str, str | None]:
        """{"frames_sha256", "audio_sha256" (None: no audio), "frames_layout", "audio_layout"}."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return {**self._result, "frames_layout": FRAMES_LAYOUT, "audio_layout": AUDIO_LAYOUT}
