"""The fast encode path: RGB -> yuv420p with torch ops, x264 with frame threads, and `bench/media.py`.

Colours are checked end to end: encode, decode with PyAV (FFmpeg's BT.601 default for the tagged stream),
compare with the input within a tolerance derived from the arithmetic (below), so a wrong matrix (BT.709
numbers in a stream decoded as BT.601: pure red's green comes back as ~24) or a wrong plane layout fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
from itertools import pairwise
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from ltx_mgpu.media.mp4 import EncodeOptions, rgb_to_yuv420p, write_mp4, write_mp4_yuv
from ltx_mgpu.media.mp4_read import read_mp4

#: Lossless H.264 (crf 0) of 2x2-aligned flat patches: the only errors are ours and the decoder's rounding.
#: Ours: the 8-bit fixed-point coefficients differ from BT.601's by <= 0.0011 (<= 0.28 code values at 255)
#: plus 0.5 of rounding: |dY|, |dU|, |dV| <= 0.8 codes. Back to RGB that is at most 1.164 * 0.8 + 2.018 * 0.8
#: (B, the largest chroma gain) = 2.55, plus the decoder's own 0.5 rounding: 3.05, so 4 allows no matrix error.
LOSSLESS_TOLERANCE = 4
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0), (128, 128, 128), (250, 200, 30),
           (20, 90, 200), (200, 30, 160), (16, 235, 128)]  # fmt: skip


def patches(frames: int = 3, height: int = 64, width: int = 80) -> torch.Tensor:
    """Flat 16x16 colour patches (aligned to the 2x2 chroma grid), shifting one patch per frame."""
    out = torch.empty((frames, height, width, 3), dtype=torch.uint8)
    for t in range(frames):
        for by in range(height // 16):
            for bx in range(width // 16):
                colour = COLOURS[(by * 5 + bx + t) % len(COLOURS)]
                out[t, by * 16 : (by + 1) * 16, bx * 16 : (bx + 1) * 16] = torch.tensor(colour, dtype=torch.uint8)
    return out


def test_lossless_round_trip_keeps_the_colours_within_the_derived_tolerance(tmp_path: Path) -> None:
    """The device path's conversion (torch ops, what a GPU driver rank runs), encoded and decoded."""
    frames = patches()
    path = tmp_path / "p.mp4"
    write_mp4_yuv(rgb_to_yuv420p(frames), path, 24.0, width=80, options=EncodeOptions(crf=0, threads=2))
    decoded, fps = read_mp4(path)
    assert decoded.shape == frames.shape and fps == pytest.approx(24.0)
    err = (decoded.int() - frames.int()).abs()
    assert int(err.max()) <= LOSSLESS_TOLERANCE, (int(err.max()), float(err.float().mean()))
    # CPU frames go through swscale (`to_yuv420p`): the same matrix; its chroma filter reaches across patch
    # edges, so the patches' interiors are held to the same tolerance
    write_mp4(frames, path, 24.0, options=EncodeOptions(crf=0, threads=2))
    interior = torch.ones(frames.shape[1:3], dtype=torch.bool)
    for edge in range(0, 80, 16):
        interior[:, max(0, edge - 2) : edge + 2] = False
        interior[max(0, edge - 2) : edge + 2, :] = False
    err = (read_mp4(path)[0].int() - frames.int()).abs()[:, interior]
    assert int(err.max()) <= LOSSLESS_TOLERANCE, int(err.max())
    with av.open(str(path)) as container:  # tagged BT.601 limited range: players must not guess BT.709 for HD
        frame = next(container.decode(container.streams.video[0]))
        assert (int(frame.colorspace), int(frame.color_range)) == (6, 1)  # SMPTE 170M (BT.601), MPEG (limited)


def test_conversion_matches_swscale_on_smooth_content() -> None:
    """On smooth pictures our planes equal swscale's rgb24 -> yuv420p (what the encoder used to do) within
    one code value (swscale filters chroma with another kernel: on noise they differ, on real content not)."""
    y = torch.linspace(0, 255, 64).view(64, 1).expand(64, 96)
    x = torch.linspace(0, 255, 96).view(1, 96).expand(64, 96)
    frames = torch.stack([x, y, (x + y) / 2], -1).round().to(torch.uint8).unsqueeze(0).repeat(2, 1, 1, 1)
    ours = rgb_to_yuv420p(frames)
    theirs = np.stack([av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray()
                       for f in frames.numpy()])  # fmt: skip
    assert ours.shape == (2, 96, 96)
    assert int((ours.int() - torch.from_numpy(theirs).int()).abs().max()) <= 1


def test_conversion_refuses_odd_sizes_and_wrong_dtypes() -> None:
    with pytest.raises(ValueError, match="even width and height"):
        rgb_to_yuv420p(torch.zeros((1, 33, 32, 3), dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 frames"):
        rgb_to_yuv420p(torch.zeros((1, 32, 32, 3), dtype=torch.float32))
    with pytest.raises(ValueError, match="yuv420p frames"):
        write_mp4_yuv(torch.zeros((1, 32, 32), dtype=torch.uint8), "/nonexistent/x.mp4", 24.0, width=30)


def test_encoder_threads_default_to_every_core_of_this_machine() -> None:
    cores = len(os.sched_getaffinity(0))
    assert EncodeOptions().thread_count == cores and EncodeOptions(threads=3).thread_count == 3
    # one x264 run per thread, runs of at least 16 frames: 121 frames are at most 7 runs
    assert EncodeOptions().segment_count(121) == min(cores, 7)
    sixteen = EncodeOptions(threads=16)
    assert sixteen.segment_count(121) == 7 and sixteen.threads_per_segment(7) == 2
    assert EncodeOptions(threads=2).segment_count(121) == 2 and EncodeOptions(threads=2).threads_per_segment(2) == 1
    assert sixteen.segment_count(17) == 1  # runs shorter than 16 frames are not worth an IDR
    assert EncodeOptions(threads=16, segments=1).segment_count(121) == 1  # one x264, 16 frame threads
    assert EncodeOptions(threads=16, segments=1).threads_per_segment(1) == 16


def test_every_core_means_the_cores_this_process_may_run_on() -> None:
    """A worker pinned to one core (a container's cpuset, `taskset`) starts one x264 thread, not the host's
    count of them (affinity is per thread on Linux: this thread's is changed and restored)."""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert EncodeOptions().thread_count == 1 and EncodeOptions().segment_count(121) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert EncodeOptions().thread_count == len(allowed)


def _packets(path: Path) -> list[tuple[int, int, bool]]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [(p.pts, p.dts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None]


def test_segments_joined_by_the_muxer_are_one_seamless_video(tmp_path: Path) -> None:
    """Three x264 encoders on three runs of frames, one mp4: lossless, it decodes to exactly what one encoder
    gives; lossy (with and without B-frames), every frame is there once, decode timestamps keep increasing
    across the joins, each run starts with a keyframe, and the pictures are one encoder's within x264's
    quantisation."""
    from bench.media import content_clip

    frames = content_clip(50, 128, 96)
    yuv = rgb_to_yuv420p(frames)
    one, three = tmp_path / "one.mp4", tmp_path / "three.mp4"
    write_mp4_yuv(yuv, one, 24.0, width=128, options=EncodeOptions(crf=0, threads=3, segments=1))
    write_mp4_yuv(yuv, three, 24.0, width=128, options=EncodeOptions(crf=0, threads=3, segments=3))
    assert torch.equal(read_mp4(one)[0], read_mp4(three)[0])
    for bframes in (0, 3):
        single, lossy = tmp_path / f"single{bframes}.mp4", tmp_path / f"lossy{bframes}.mp4"
        options = EncodeOptions(crf=18, bframes=bframes, threads=3)
        write_mp4_yuv(yuv, single, 24.0, width=128, options=dataclasses.replace(options, segments=1))
        write_mp4_yuv(yuv, lossy, 24.0, width=128, options=dataclasses.replace(options, segments=3))
        packets = _packets(lossy)
        ticks = sorted(pts for pts, _, _ in packets)
        assert len(ticks) == 50 and len({b - a for a, b in pairwise(ticks)}) == 1  # every frame once, evenly
        assert all(a[1] < b[1] for a, b in pairwise(packets))
        step = ticks[1] - ticks[0]
        assert {pts // step for pts, _, key in packets if key} >= {0, 17, 33}  # each run opens with a keyframe
        decoded, reference = read_mp4(lossy)[0], read_mp4(single)[0]
        assert decoded.shape == reference.shape == frames.shape
        error, one_error = (float((x.float() - frames.float()).abs().mean()) for x in (decoded, reference))
        assert error < 1.1 * one_error < 6  # (4:2:0 alone costs ~3 on this clip's sharp edges at 128x96)
        assert float((decoded.float() - reference.float()).abs().mean()) < 2


def test_segments_keep_the_aac_track_beside_them(tmp_path: Path) -> None:
    """The runs are muxed before the audio is encoded: the file still has both streams, whole."""
    from ltx_mgpu.media.mp4 import AudioTrack
    from ltx_mgpu.media.mp4_read import probe_mp4

    t = torch.arange(5 * 24000, dtype=torch.float32) / 24000
    wave = torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * t)] * 2)
    yuv = rgb_to_yuv420p(torch.randint(0, 256, (40, 64, 96, 3), dtype=torch.uint8))
    path = tmp_path / "av.mp4"
    write_mp4_yuv(yuv, path, 8.0, width=96, audio=AudioTrack(wave, 24000), options=EncodeOptions(threads=2, segments=2))
    streams = probe_mp4(path)
    assert (streams.video_codec, streams.frames, streams.audio_codec, streams.audio_channels) == ("h264", 40, "aac", 2)
    assert abs((streams.audio_duration_s or 0) - streams.video_duration_s) < 1024 / 24000
    packets = _packets(path)
    assert all(a[1] < b[1] for a, b in pairwise(packets)) and sum(key for *_, key in packets) >= 2


def test_a_run_whose_headers_differ_from_the_stream_header_is_not_joined(tmp_path: Path, monkeypatch) -> None:
    """SPS/PPS are written once, in the mp4 header, from the stream's own encoder: a run encoded with other
    parameters (here 3 reference frames instead of 1) would decode wrongly, so the encode fails and leaves
    no file."""
    from ltx_mgpu.media import x264_segments

    real = x264_segments._encode_run

    def other_headers(frames, lo, hi, width, height, rate, settings):  # type: ignore[no-untyped-def]
        if lo > 0:
            options = dict(settings["options"], **{"x264-params": settings["options"]["x264-params"] + ":ref=3"})
            settings = dict(settings, options=options)
        return real(frames, lo, hi, width, height, rate, settings)

    monkeypatch.setattr(x264_segments, "_encode_run", other_headers)
    path = tmp_path / "bad.mp4"
    yuv = rgb_to_yuv420p(torch.zeros((48, 64, 64, 3), dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="SPS/PPS"):
        write_mp4_yuv(yuv, path, 24.0, width=64, options=EncodeOptions(threads=3, segments=3))
    assert list(tmp_path.iterdir()) == []


def test_the_segment_pool_is_bounded_by_the_runs_asked_for(tmp_path: Path, monkeypatch) -> None:
    """Threads, not a process per run: a pool of at most as many as the largest segment count asked for."""
    from ltx_mgpu.media import x264_segments

    monkeypatch.setattr(x264_segments, "_pool", None)  # (a pool of this process's earlier encodes stays apart)
    monkeypatch.setattr(x264_segments, "_pool_size", 0)
    yuv = rgb_to_yuv420p(torch.zeros((48, 64, 64, 3), dtype=torch.uint8))
    try:
        for segments in (3, 2, 3):
            options = EncodeOptions(threads=3, segments=segments)
            write_mp4_yuv(yuv, tmp_path / "b.mp4", 24.0, width=64, options=options)
        pool = x264_segments._pool
        assert pool is not None and x264_segments._pool_size == 3 and 1 <= len(pool._threads) <= 3
    finally:
        if x264_segments._pool is not None:
            x264_segments._pool.shutdown(wait=True)


def test_bench_media_quick_reports_old_and_new_per_case(tmp_path: Path) -> None:
    from bench.media import main

    out = tmp_path / "media.jsonl"
    assert main(["--quick", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    cases = [json.loads(line) for line in lines[:-1]]
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    assert [(c["clip"], c["size"]) for c in cases] == [("noise", "256x160"), ("content", "256x160")]
    for case in cases:
        assert case["old_s"] > 0 and case["new_encode_s"] > 0 and case["old_bytes"] > 0 and case["new_bytes"] > 0
        assert case["current_s"] > 0 and case["current_bytes"] > 0  # one x264: what the worker ran before
        assert case["speedup_encode"] == pytest.approx(case["old_s"] / case["new_encode_s"], rel=0.01)
        check = case["new_check"]
        assert check["ok"] and check["frames"] == 9 and check["pts_even"] and check["dts_increasing"]
    assert summary["threads"] == summary["usable_cores"] == len(os.sched_getaffinity(0)) and summary["cases"] == cases
    assert (summary["crf"], summary["preset"]) == (EncodeOptions.crf, EncodeOptions.preset)
    assert summary["tune"] == EncodeOptions.tune and summary["all_new_files_ok"] and summary["target"] is None
