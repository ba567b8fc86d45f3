"""How much of the worker's mp4 encode a streamed hand-off moves into the VAE decode (CPU only, torch + av).

The decode is simulated: the video's frames become final in `--chunks` equal pieces spread over `--decode-s`
seconds (what the fleet's `media_frames` events announce). Two paths on the same frames with the worker's
default `EncodeOptions` (`--threads`/`--segments` override):

- once: the decode, then `write_mp4_yuv` on the whole video (`LTX_ENCODE_STREAM=false`);
- stream: `Mp4Stream` fed as the chunks come (its x264 runs start on each chunk's frames), then the mux.

Per case (clip x size x decode time): `once_s` and `stream_s` from the decode's start to the mp4 written,
`stream_tail_s` / `once_tail_s` the part after the decode's end (what stays on a job's latency), the
stream's `encode_overlap_s`, and whether the two files are the same bytes. One JSON line per case, then
`SUMMARY {...}`. The GPU host's figures: pass the measured decode times of the sizes, e.g.

    python -m bench.stream_encode --sizes 768x512x121,1536x1024x121 --decode-s 0.23,1.33
    python -m bench.stream_encode --quick          # 33 frames at 256x160 (seconds, on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_summary
from bench.media import content_clip, noise_clip
from ltx_mgpu.media.mp4 import EncodeOptions, shared_empty, to_yuv420p, write_mp4_yuv
from ltx_mgpu.media.mp4_stream import Mp4Stream


def _decode(buffer: Any, yuv: Any, chunks: int, decode_s: float, on_chunk: Any) -> float:
    """Frames become final chunk by chunk, evenly over `decode_s`; returns when the last is (monotonic)."""
    start, total = time.monotonic(), len(yuv)
    for k in range(1, chunks + 1):
        lo, hi = round((k - 1) * total / chunks), round(k * total / chunks)
        time.sleep(max(0.0, start + decode_s * k / chunks - time.monotonic()))
        buffer[lo:hi] = yuv[lo:hi]
        on_chunk(hi)
    return time.monotonic()


def one_case(clip: str, width: int, height: int, frames: int, decode_s: float, args: argparse.Namespace,
             options: EncodeOptions, tmp: Path) -> dict[str, Any]:  # fmt: skip
    rgb = noise_clip(frames, width, height) if clip == "noise" else content_clip(frames, width, height)
    yuv = to_yuv420p(rgb)
    # once: decode, then encode the whole video
    buffer = shared_empty(tuple(yuv.shape), yuv.dtype)
    t0 = time.monotonic()
    decoded = _decode(buffer, yuv, args.chunks, decode_s, lambda _: None)
    write_mp4_yuv(buffer, tmp / "once.mp4", 24.0, width=width, options=options)
    once_end = time.monotonic()
    # stream: runs start as chunks arrive (the job function's thread feeds them; here the "decode" thread)
    buffer = shared_empty(tuple(yuv.shape), yuv.dtype)
    event = {"type": "media_open", "video": buffer, "width": width, "height": height, "fps": 24.0, "frames": frames}
    stream = Mp4Stream(event, options)
    s0 = time.monotonic()
    ended: list[float] = []
    feeder = threading.Thread(
        target=lambda: ended.append(
            _decode(
                buffer,
                yuv,
                args.chunks,
                decode_s,
                lambda ready: stream.advance({"ready": ready, "at": time.monotonic()}),
            )
        )
    )
    feeder.start()
    feeder.join()
    media = stream.finish({"type": "media", "streamed": True, "audio": None, "audio_sample_rate": None})
    write_mp4_yuv(media["video"], tmp / "stream.mp4", 24.0, width=width, options=options, stream=stream.runs)
    stream_end = time.monotonic()
    started = min(s0 + decode_s, stream.started_at() or stream_end)
    same = (tmp / "once.mp4").read_bytes() == (tmp / "stream.mp4").read_bytes()
    return {"kind": "case", "clip": clip, "size": f"{width}x{height}x{frames}", "decode_s": decode_s,
            "chunks": args.chunks, "runs": options.segment_count(frames), "once_s": round(once_end - t0, 4),
            "stream_s": round(stream_end - s0, 4), "once_tail_s": round(once_end - decoded, 4),
            "stream_tail_s": round(stream_end - ended[0], 4), **stream.timings(started, stream_end),
            "same_bytes": same, "bytes": (tmp / "stream.mp4").stat().st_size}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="768x512x121,1536x1024x121", help="WxHxF, comma-separated")
    ap.add_argument("--decode-s", default="0.23,1.33", help="simulated decode seconds, one per size (or one)")
    ap.add_argument("--chunks", type=int, default=3, help="pieces the decode announces (3: ltx-core's 64/24)")
    ap.add_argument("--clips", default="noise,content")
    ap.add_argument("--threads", type=int, default=0, help="EncodeOptions.threads (0: every usable core)")
    ap.add_argument("--segments", type=int, default=0, help="EncodeOptions.segments (0: one run per thread)")
    ap.add_argument("--quick", action="store_true", help="33 frames at 256x160, decode 0.3 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.decode_s, args.clips = "256x160x33", "0.3", "content"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = EncodeOptions(threads=args.threads, segments=args.segments)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    decodes = [float(x) for x in args.decode_s.split(",") if x]
    decodes = decodes * len(sizes) if len(decodes) == 1 else decodes
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for (width, height, frames), decode_s in zip(sizes, decodes, strict=True):
            for clip in args.clips.split(","):
                case = one_case(clip, width, height, frames, decode_s, args, options, Path(tmp))
                emit(case)
                cases.append(case)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    summary = {"cores": cores, "threads": options.thread_count, "cases": cases,
               "all_same_bytes": all(c["same_bytes"] for c in cases),
               "tail_ratio": {f"{c['clip']} {c['size']}": round(c["stream_tail_s"] / c["once_tail_s"], 3)
                              for c in cases if c["once_tail_s"]}}  # fmt: skip
    emit_summary(summary)
    return 0 if summary["all_same_bytes"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
