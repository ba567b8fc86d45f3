"""The worker's streamed encode (`LTX_ENCODE_STREAM`, the default): real Redis, real S3 (SeaweedFS), a real
`ltx-worker one` with a CPU fleet running the fault runner's streamed hand-off (noise frames in chunks, a
pause before each chunk standing in for the VAE's decode time).

- The x264 runs start while the fleet still decodes: `rendered` reports `encode_overlap_s` > 0, measured
  by the encoder's own run start against the runner's stamp on its last decoded chunk (not a wall-time
  guess by the test); the uploaded mp4 (sha256 checked) decodes to exactly the one-shot encode of the same
  frames with the same settings.
- A render that fails (`runner_error`) or is cancelled after its frames began to arrive ends the job,
  abandons its encode (`ltx_worker_encode_aborted_total`), leaves no encode pending and nothing in the
  spool, and the worker renders the next job as usual.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ltx_contract.control import cancel_job
from ltx_mgpu.media.mp4 import EncodeOptions, to_yuv420p, write_mp4_yuv
from ltx_mgpu.media.mp4_read import read_mp4
from tests.support.fleet import metric, running_worker
from tests.support.runners import noise_frames
from tests.support.wait import wait_for
from tests.support.workers import events, wait_state
from tests.test_worker_encode import _stored_video

pytestmark = pytest.mark.timeout(300)
SIZE = {"width": 64, "height": 64}
ENCODE = {"encode_threads": 2, "encode_segments": 4}  # 64 frames: 4 runs of 16


def _rendered(evts: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in evts if e.get("state") == "rendered")


def test_a_streamed_render_encodes_while_the_fleet_decodes(tmp_path, redis_server, s3_server):
    with running_worker(tmp_path, redis_server, s3_server, **ENCODE) as f:
        # four chunks of 16 frames, 0.5 s of "decode" before each: the first runs can start 1 s before the end
        a = f.submit("t yuv=64 chunk=16 chunk_s=0.5", seed=5, **SIZE)
        assert wait_state(a, {"uploaded", "failed"}, 240, f.proc) == "uploaded", a.get_meta()
        evts = events(f.conn, a.id)
        (output,) = [e for e in evts if e["type"] == "output"]
        assert output["media"] == "stream" and not any(e["type"].startswith("media") for e in evts)
        rendered = _rendered(evts)
        assert rendered["encode_overlap_s"] > 0 and rendered["encode_tail_s"] >= 0, rendered
        assert rendered["encode_s"] >= rendered["encode_overlap_s"]
        video = _stored_video(s3_server, a.latest_result().return_value, tmp_path)  # (its sha256 checked)
        one_shot = tmp_path / "one-shot.mp4"
        write_mp4_yuv(to_yuv420p(noise_frames(64, 64, 64, 5)), one_shot, 24.0, width=64,
                      options=EncodeOptions(threads=2, segments=4))  # fmt: skip
        streamed, expected = read_mp4(video)[0], read_mp4(one_shot)[0]
        assert streamed.shape == (64, 64, 64, 3) and torch.equal(streamed, expected)


def test_a_render_failing_or_cancelled_mid_stream_aborts_its_encode_and_the_worker_goes_on(tmp_path, redis_server,
                                                                                          s3_server):  # fmt: skip
    with running_worker(tmp_path, redis_server, s3_server, **ENCODE) as f:
        bad = f.submit("t yuv=64 chunk=16 stream_fail=3", seed=6, **SIZE)  # 48 frames in: 3 runs started
        cancelled = f.submit("t yuv=64 chunk=16 chunk_s=1", seed=8, **SIZE)  # cancelled while it decodes
        good = f.submit("t yuv=64 chunk=16", seed=7, **SIZE)
        assert wait_state(bad, {"uploaded", "failed"}, 240, f.proc) == "failed", bad.get_meta()
        assert bad.get_meta(refresh=True)["error"]["reason"] == "runner_error"
        assert not any(e.get("state") == "rendered" for e in events(f.conn, bad.id))
        wait_for(lambda: any(e.get("stage") == "decode" for e in events(f.conn, cancelled.id)), 120, "the decode")
        assert cancel_job(f.conn, cancelled.id) == "stop_requested"
        assert wait_state(cancelled, {"cancelled", "uploaded", "failed"}, 240, f.proc) == "cancelled"
        assert wait_state(good, {"uploaded", "failed"}, 240, f.proc) == "uploaded", good.get_meta()
        assert read_mp4(_stored_video(s3_server, good.latest_result().return_value, tmp_path))[0].shape[0] == 64
        assert not (f.spool / bad.id).exists() and not (f.spool / cancelled.id).exists()  # no marker, no file
        port = f.health()["metrics_port"]
        pending = metric(port, "ltx_worker_encode_pending{")
        assert pending is not None and float(pending.split()[-1]) == 0.0, pending
        aborted = metric(port, "ltx_worker_encode_aborted_total{")  # the failed render's runs were abandoned
        assert aborted is not None and float(aborted.split()[-1]) == 2.0, aborted
