"""The streamed hand-off (`media="stream"`): frames reach the encoder while the VAE decodes.

Encoder side (`Mp4Stream`, `SegmentStream`): x264 runs start as soon as their frames are announced, and the
file they make is the one-shot encode's byte for byte (same runs, same frames, same settings); an abort
leaves no run waiting. Runner side, on the tiny LTX-2 checkpoints in one process (`LocalRunner`) with the
chunked decode: the events come in order (buffer, frames in chunks, audio, output), the streamed mp4
decodes to the frames of the one-shot hand-off (`media="frames"`), the first x264 run started before the
runner's decode announced its last frames (the encoder's own start stamp against the runner's stamp; the
consumer lets the run start before it resumes the decode, so no timing guess), and a decode that fails
after the buffer was handed off ends the render with the encoder's side aborted and the buffer freed.
"""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import torch

from ltx_mgpu.media.mp4 import AudioTrack, EncodeOptions, shared_empty, write_mp4_yuv
from ltx_mgpu.media.mp4_read import read_mp4
from ltx_mgpu.media.mp4_stream import Mp4Stream
from tests.support.wait import wait_for

W = H = 64
OPTIONS = EncodeOptions(threads=2, segments=4)  # 64 frames: 4 runs of 16, 1 frame thread each


def _yuv(frames: int, seed: int = 0) -> torch.Tensor:
    """Moving gradients plus a little noise: cheap to encode, and any misplaced frame shows."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0 : H * 3 // 2, 0:W]
    clip = [((xs * 3 + ys * 2 + 5 * t + rng.integers(0, 8, xs.shape)) % 256).astype(np.uint8) for t in range(frames)]
    return torch.from_numpy(np.stack(clip))


def _open(buffer: torch.Tensor) -> dict:
    return {"type": "media_open", "video": buffer, "width": W, "height": H, "fps": 24.0, "frames": len(buffer)}


def _wait_started(stream: Mp4Stream, runs: int, timeout: float = 60.0) -> None:
    def started() -> bool:
        jobs = stream.runs.jobs()
        return len(jobs) >= runs and all(j.running() or j.done() for j in jobs[:runs])

    wait_for(started, timeout, f"{runs} x264 run(s) started", poll=0.005)


def test_runs_start_as_their_frames_arrive_and_make_the_one_shot_file(tmp_path):
    clip = _yuv(64)
    buffer = shared_empty(tuple(clip.shape), torch.uint8)
    stream = Mp4Stream(_open(buffer), OPTIONS)
    assert stream.runs is not None and stream.runs.bounds == [0, 16, 32, 48, 64]
    done = 0
    for ready, runs in ((10, 0), (20, 1), (47, 2), (64, 4)):
        buffer[done:ready] = clip[done:ready]  # the runner's copy, then its event
        done = ready
        stream.advance({"type": "media_frames", "ready": ready, "at": time.monotonic()})
        assert len(stream.runs.jobs()) == runs  # only runs whose every frame is final
    wave = torch.sin(torch.linspace(0, 600, 24000 * 64 // 24)).repeat(2, 1) * 0.3
    media = stream.finish({"type": "media", "streamed": True, "audio": wave, "audio_sample_rate": 24000})
    track = AudioTrack(media["audio"], 24000)
    write_mp4_yuv(media["video"], tmp_path / "s.mp4", 24.0, width=W, audio=track, options=OPTIONS, stream=stream.runs)
    write_mp4_yuv(clip, tmp_path / "o.mp4", 24.0, width=W, audio=track, options=OPTIONS)
    # the same runs on the same frames: x264 is deterministic at a given thread count, and so is the muxer
    assert (tmp_path / "s.mp4").read_bytes() == (tmp_path / "o.mp4").read_bytes()
    streamed, one_shot = read_mp4(tmp_path / "s.mp4")[0], read_mp4(tmp_path / "o.mp4")[0]
    assert streamed.shape == (64, H, W, 3) and torch.equal(streamed, one_shot)
    ended = time.monotonic()
    timing = stream.timings(stream.started_at(), ended)
    assert timing["encode_overlap_s"] >= 0 and timing["encode_tail_s"] > 0


def test_an_abort_leaves_no_run_waiting_for_frames():
    clip = _yuv(64)
    buffer = shared_empty(tuple(clip.shape), torch.uint8)
    stream = Mp4Stream(_open(buffer), OPTIONS)
    buffer[:20] = clip[:20]
    stream.advance({"type": "media_frames", "ready": 20, "at": time.monotonic()})
    assert len(stream.runs.jobs()) == 1
    stream.abort()
    stream.advance({"type": "media_frames", "ready": 64, "at": time.monotonic()})  # (late events start nothing)
    assert len(stream.runs.jobs()) == 1
    with pytest.raises(RuntimeError, match="20 of 64 frames"):
        next(stream.runs.runs())  # a mux never waits for frames that will not come
    with pytest.raises(RuntimeError, match="20 of 64"):
        stream.finish({"type": "media", "streamed": True, "audio": None, "audio_sample_rate": None})
    (run,) = stream.runs.jobs()
    assert run.cancelled() or run.result(timeout=60) is not None  # not started: cancelled; started: it ends
    assert stream.runs.pending() == 0


# ---- the LTX-2 runner on tiny checkpoints, one process --------------------------------------------------------
JOB = {"prompt": "a cat walks along the beach", "width": 128, "height": 128, "num_frames": 121, "frame_rate": 24.0,
       "seed": 4}  # fmt: skip


@pytest.fixture(scope="module")
def local():
    from ltx_mgpu.runners.common.local import LocalRunner
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    kw = ensure_tiny_ltx2().setup_kwargs()
    kw.pop("distilled_lora_path")
    with LocalRunner(Ltx2DistilledRunner) as runner:
        # temporal chunks of 64 frames (24 of overlap, ltx-core's default): 121 frames decode in three
        runner.start(**kw, prompt_tokens=128, default_steps=1, dtype="float32", vae_chunk_frames=64)
        yield runner


def test_vae_chunk_frames_is_checked_at_setup():
    from ltx_mgpu.runners.ltx2.components import _temporal_chunks

    assert _temporal_chunks(0) is None and _temporal_chunks(64).temporal_config.tile_overlap_in_frames == 24
    with pytest.raises(ValueError, match="vae_chunk_frames must be 0 or a multiple of 8 from 16, got 20"):
        _temporal_chunks(20)


def test_the_lower_memory_plan_still_chunks_space_over_setup_temporal_chunks():
    from types import SimpleNamespace

    from ltx_core.model.video_vae import TilingConfig

    from ltx_mgpu.runners.ltx2.base import Ltx2Runner
    from ltx_mgpu.runners.ltx2.components import _temporal_chunks

    runner = Ltx2Runner.__new__(Ltx2Runner)
    runner.setup_chunk_tiling, runner.decoder = _temporal_chunks(64), SimpleNamespace(chunk_tiling=None)
    runner._use_memory_plan({"decode_chunked": True})
    assert runner.decoder.chunk_tiling == TilingConfig.default()  # (temporal chunks alone bound no tile's area)
    runner._use_memory_plan(None)
    assert runner.decoder.chunk_tiling == _temporal_chunks(64)


def test_ltx2_streams_its_chunked_decode_into_the_encoder(local, tmp_path):
    events, stream, frames_events = [], None, []
    for e in local.stream(output_path=str(tmp_path / "unused.mp4"), media="stream", **JOB):
        events.append(e)
        if e.get("type") == "media_open":
            stream = Mp4Stream(e, OPTIONS)
        elif e.get("type") == "media_frames":
            frames_events.append(e)
            stream.advance(e)
            if stream.runs.jobs() and e["ready"] < e["frames"]:
                _wait_started(stream, 1)  # let the first run begin before the decode goes on
    kinds = [e["type"] for e in events if e.get("type", "").startswith("media") or e.get("type") == "output"]
    assert kinds[0] == "media_open" and kinds[-2:] == ["media", "output"], kinds
    assert len(frames_events) >= 2 and frames_events[-1]["ready"] == 121, frames_events  # decoded in chunks
    closing = next(e for e in events if e.get("type") == "media")
    output = events[-1]
    assert output["media"] == "stream" and output["frames"] == 121 and not (tmp_path / "unused.mp4").exists()
    assert {"decode", "handoff"} <= set(output["timings_s"])
    media = stream.finish(closing)
    track = AudioTrack(media["audio"], int(media["audio_sample_rate"]))
    write_mp4_yuv(media["video"], tmp_path / "s.mp4", 24.0, width=128, audio=track, options=OPTIONS,
                  stream=stream.runs)  # fmt: skip
    # the encoder's first run began before the runner announced its last decoded frames
    assert stream.started_at() < stream.decoded_at == frames_events[-1]["at"]
    assert stream.timings(stream.started_at(), time.monotonic())["encode_overlap_s"] > 0

    # the one-shot hand-off of the same job: the same frames (bit for bit: same decode, same conversion)
    whole = local.run(output_path=str(tmp_path / "unused.mp4"), media="frames", **JOB)
    (handed,) = [e for e in whole if isinstance(e, dict) and e.get("type") == "media"]
    assert torch.equal(handed["video"], media["video"])
    write_mp4_yuv(handed["video"], tmp_path / "o.mp4", 24.0, width=128, audio=track, options=OPTIONS)
    assert torch.equal(read_mp4(tmp_path / "s.mp4")[0], read_mp4(tmp_path / "o.mp4")[0])


def test_a_decode_that_fails_mid_stream_ends_the_render_and_frees_the_buffer(local, tmp_path, monkeypatch):
    decoder = local.runner.decoder.decoder
    real = decoder.tiled_decode

    def failing(*args, **kwargs):
        for k, chunk in enumerate(real(*args, **kwargs)):
            if k == 2:
                raise torch.OutOfMemoryError("injected: out of memory in the middle of the decode")
            yield chunk

    monkeypatch.setattr(decoder, "tiled_decode", failing)
    stream, seen = None, []
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        try:
            for e in local.stream(output_path=str(tmp_path / "x.mp4"), media="stream", **JOB):
                seen.append(e.get("type"))
                if e.get("type") == "media_open":
                    stream = Mp4Stream(e, OPTIONS)
                elif e.get("type") == "media_frames":
                    stream.advance(e)
        except BaseException:
            stream.abort()  # what the worker does (`worker.render.fleet_render.FleetRender.abort_stream`)
            raise
    assert "media_open" in seen and "media_frames" in seen and "media" not in seen and "output" not in seen
    assert 0 < stream.ready < 121
    for job in stream.runs.jobs():  # started runs end on their own, the rest never start
        assert job.cancelled() or job.result(timeout=60) is not None
    assert stream.runs.pending() == 0
    buffer = weakref.ref(stream.video)
    del stream, e
    gc.collect()
    assert buffer() is None  # nothing (the runner's generator included) holds the shared memory


def test_the_stream_bench_runs_and_its_files_match(capsys):
    """`python -m bench.stream_encode --quick` runs (what CI can afford): the streamed encode of a simulated chunked
    decode writes the one-shot file. (How early its runs start is timing: the tests above pin it.)"""
    import json

    from bench.stream_encode import main

    assert main(["--quick"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("SUMMARY "))
    (case,) = summary["cases"]
    assert case["same_bytes"] and case["runs"] == 2 and case["encode_overlap_s"] >= 0
