"""The mp4 encode of one rendered video, old path against new, in the same run (CPU only; CI runs `--quick`).

- old: what the runner's driver rank did before the hand-off: per frame `VideoFrame.from_ndarray(rgb24)`,
  swscale to yuv420p inside the encoder call, x264 `veryfast` at crf 18 with PyAV's default sliced threads;
- new: `ltx_mgpu.runners.common.media`: RGB -> yuv420p with torch ops (timed separately: on a GPU fleet it
  runs on the device; with CUDA `fleet_handoff_cuda_s` is that conversion plus the one copy into shared
  memory, what the fleet pays instead of the encode), then `write_mp4_yuv` (parallel x264 segments with
  frame threads on every core, the worker's default `EncodeOptions`; `--preset`/`--crf`/`--threads`/
  `--segments` override).

Clips (121 frames by default, at 768x512 and 1536x1024): `noise` (uniform random pixels: the worst case,
and what synthetic weights render) and `content` (smooth moving shapes over gradients: a stand-in for real
video, 3-4x cheaper to encode). Each case is encoded `--repeats` times per path (median seconds kept).

    python bench/media.py                          # the full grid (tens of seconds per case on 2 cores)
    python bench/media.py --quick                  # 9 frames at 256x160: what CI and the tests run
    python bench/media.py --sizes 1536x1024 --clips noise --repeats 3

One JSON line per case (old and new seconds, the conversion's seconds, bytes, ratios), then
`SUMMARY {...}` with every case, the threads used and the machine's core count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu.runners.common.media import EncodeOptions, rgb_to_yuv420p, shared_host_copy, to_yuv420p, write_mp4_yuv


def noise_clip(frames: int, width: int, height: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, height, width, 3), generator=gen, dtype=torch.uint8)


def content_clip(frames: int, width: int, height: int) -> torch.Tensor:
    """Smooth gradients with two soft discs moving across them (uint8 (F, H, W, 3))."""
    y = torch.linspace(0, 1, height).view(height, 1)
    x = torch.linspace(0, 1, width).view(1, width)
    out = torch.empty((frames, height, width, 3), dtype=torch.uint8)
    for t in range(frames):
        phase = t / max(1, frames - 1)
        base = torch.stack([x.expand(height, width), y.expand(height, width), (x + y).expand(height, width) / 2], -1)
        base = (base + phase * 0.3) % 1.0
        for cx, cy, colour in ((0.2 + 0.6 * phase, 0.5, (1.0, 0.2, 0.1)), (0.7, 0.2 + 0.5 * phase, (0.1, 0.3, 1.0))):
            d2 = ((x - cx) * width / height) ** 2 + (y - cy) ** 2
            alpha = torch.exp(-d2 / 0.01).unsqueeze(-1)
            base = base * (1 - alpha) + torch.tensor(colour) * alpha
        out[t] = (base * 255).round().clamp(0, 255).to(torch.uint8)
    return out


def old_encode(frames: torch.Tensor, path: Path, fps: float = 24.0, crf: int = 18) -> int:
    """The runner path before the hand-off, kept verbatim in behaviour (rgb24 frames, swscale, sliced threads)."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = int(frames.shape[2]), int(frames.shape[1]), "yuv420p"
        video.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in frames.numpy():
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
    return path.stat().st_size


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    samples, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), value


def one_case(clip: str, width: int, height: int, args: argparse.Namespace, options: EncodeOptions,
             workdir: Path) -> dict[str, Any]:  # fmt: skip
    frames = noise_clip(args.frames, width, height) if clip == "noise" else content_clip(args.frames, width, height)
    old_s, old_bytes = timed(lambda: old_encode(frames, workdir / "old.mp4", crf=args.crf), args.repeats)
    convert_s, yuv = timed(lambda: to_yuv420p(frames), args.repeats)  # (swscale on the CPU, as a CPU rank does)
    handoff_s = None
    if args.device == "cuda":  # what the fleet pays instead of the encode: convert there, one copy out
        on_device = frames.cuda()

        def handoff() -> torch.Tensor:
            out = shared_host_copy(rgb_to_yuv420p(on_device))
            torch.cuda.synchronize()
            return out

        handoff()  # (warm-up: the first call pays CUDA's lazy initialisation)
        handoff_s, from_device = timed(handoff, args.repeats)
        assert torch.equal(from_device, rgb_to_yuv420p(frames)), "the device conversion differs from torch's on CPU"
    new_s, new_bytes = timed(lambda: write_mp4_yuv(yuv, workdir / "new.mp4", 24.0, width=width, options=options),
                             args.repeats)  # fmt: skip
    return {
        "kind": "case",
        "clip": clip,
        "size": f"{width}x{height}",
        "frames": args.frames,
        "old_s": round(old_s, 4),
        "new_encode_s": round(new_s, 4),
        "new_convert_cpu_s": round(convert_s, 4),
        "new_total_cpu_s": round(new_s + convert_s, 4),
        "fleet_handoff_cuda_s": None if handoff_s is None else round(handoff_s, 4),
        "speedup_encode": round(old_s / new_s, 3) if new_s else None,
        "speedup_with_cpu_convert": round(old_s / (new_s + convert_s), 3),
        "old_bytes": old_bytes,
        "new_bytes": new_bytes,
        "bytes_ratio": round(new_bytes / old_bytes, 4) if old_bytes else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="9 frames at 256x160, one repeat (seconds, for CI)")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--sizes", default="768x512,1536x1024")
    ap.add_argument("--clips", default="noise,content")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--crf", type=int, default=EncodeOptions.crf)
    ap.add_argument("--preset", default=EncodeOptions.preset)
    ap.add_argument("--threads", type=int, default=0, help="x264 threads of the new path (0: every core)")
    ap.add_argument("--segments", type=int, default=EncodeOptions.segments,
                    help="x264 segments in a process pool (0: one per 4 threads)")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="also time the fleet's hand-off on CUDA (auto: if there is one)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.frames, args.sizes, args.repeats = 9, "256x160", 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = EncodeOptions(crf=args.crf, preset=args.preset, threads=args.threads, segments=args.segments)
    lines: list[str] = []
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-media-") as tmp:
        for size in args.sizes.split(","):
            width, height = (int(v) for v in size.lower().split("x"))
            for clip in args.clips.split(","):
                case = one_case(clip.strip(), width, height, args, options, Path(tmp))
                cases.append(case)
                lines.append(json.dumps(case))
                print(lines[-1], flush=True)
    summary = {
        "cores": os.cpu_count(),
        "threads": options.thread_count,
        "segments_at_121_frames": options.segment_count(121),
        "crf": options.crf,
        "preset": options.preset,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cases": cases,
    }
    lines.append("SUMMARY " + json.dumps(summary))
    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
