"""The fleet's hand-off copy on CUDA: device yuv420p frames into page-locked shared memory, unlocked after.
Skipped cleanly without CUDA. Run on the GPU machine:

    pytest -m gpu tests/test_media_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.media.mp4 import rgb_to_yuv420p, shared_host_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("pinned", [True, False])
def test_the_hand_off_copy_is_the_device_frames_in_shared_memory(pinned: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    frames = torch.randint(0, 256, (17, 64, 96, 3), generator=gen, dtype=torch.uint8, device="cuda")
    yuv = rgb_to_yuv420p(frames)
    host = shared_host_copy(yuv, pinned=pinned)
    assert host.device.type == "cpu" and host.is_shared() and torch.equal(host, yuv.cpu())
    assert not host.is_pinned()  # the pages were unlocked after the copy (locked memory is a scarce resource)


def test_the_streamed_hand_off_fills_its_page_locked_buffer_chunk_by_chunk() -> None:
    """`FrameStream` on CUDA: the buffer is locked for the decode, each chunk lands in its place before its
    event, and the pages are unlocked at `release` (the streamed hand-off's `finally`)."""
    from ltx_mgpu.runners.common.handoff import FrameStream

    gen = torch.Generator(device="cuda").manual_seed(4)
    frames = torch.randint(0, 256, (41, 64, 96, 3), generator=gen, dtype=torch.uint8, device="cuda")
    stream = FrameStream(frames=41, width=96, height=64, fps=24.0, device=torch.device("cuda"))
    buffer = stream.open_event()["video"]
    assert buffer.is_shared() and buffer.is_pinned()
    for lo, hi in ((0, 17), (17, 33), (33, 41)):
        assert stream.put(frames[lo:hi])["ready"] == hi
        assert torch.equal(buffer[:hi], rgb_to_yuv420p(frames[:hi]).cpu())  # synchronised: already there
    stream.release()
    stream.release()  # (safe to repeat)
    assert not buffer.is_pinned()
