"""The mp4 encode of one rendered video: the old, the current and the new path in the same run (CPU only; CI
runs `--quick`).

- old: what the runner's driver rank did before the hand-off: per frame `VideoFrame.from_ndarray(rgb24)`,
  swscale to yuv420p inside the encoder call, x264 `veryfast` at crf 18 with PyAV's default sliced threads;
- current: `write_mp4_yuv` as the worker ran it before segment-parallel encoding: one x264 with frame
  threads on every core, the preset's B-frames and CABAC (no tune); same crf and preset as the new path;
- new: `write_mp4_yuv` with the worker's default `EncodeOptions` (parallel x264 runs joined by the muxer;
  `--preset`/`--tune`/`--crf`/`--threads`/`--segments` override). Its frames are RGB -> yuv420p by the
  fleet (timed separately: `fleet_handoff_cuda_s` with CUDA, the device conversion and the one copy into
  page-locked shared memory, `fleet_handoff_pageable_cuda_s` the same with the pageable copy used before;
  on the CPU swscale's `new_convert_cpu_s`).
- `--variants "segments=16,tune=fastdecode:segments=4"`: more settings of the new path, timed beside it.

Every path reports wall seconds, the process's CPU seconds over them (`*_cpu_s`; their ratio is how many
cores it kept busy: when it is the core count, only less work per frame is faster) and bytes. The new
file is checked: one packet per frame, presentation times one frame apart, decode times increasing.

Clips (121 frames by default, at 768x512 and 1536x1024): `noise` (uniform random pixels: the worst case,
and what synthetic weights render) and `content` (smooth moving shapes over gradients: a stand-in for real
video, 3-4x cheaper to encode). Each case is encoded `--repeats` times per path (median seconds kept).

    python -m bench.media                          # the full grid (tens of seconds per case on 2 cores)
    python -m bench.media --quick                  # 9 frames at 256x160: what CI and the tests run
    python -m bench.media --sizes 1536x1024 --clips noise --repeats 3

One JSON line per case (`--table`: a short line per case), then `SUMMARY {...}` with every case, the
settings, the machine's core count and `target`: the new path's speed-up over the old one on noise at
1536x1024 (the goal: >= 3x).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from ltx_mgpu.media.mp4 import (
    EncodeOptions,
    rgb_to_yuv420p,
    shared_host_copy,
    to_yuv420p,
    usable_cores,
    write_mp4_yuv,
)


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


def timed(fn: Any, repeats: int) -> tuple[float, Any, float]:
    """Median wall seconds, the last value and the CPU seconds (all threads of this process) of that run."""
    samples, value, cpu = [], None, 0.0
    for _ in range(repeats):
        before, start = os.times(), time.perf_counter()
        value = fn()
        samples.append(time.perf_counter() - start)
        after = os.times()
        cpu = (after.user - before.user) + (after.system - before.system)
    return statistics.median(samples), value, cpu


def stream_check(path: Path) -> dict[str, Any]:
    """What a player relies on, read from the container (no decode): one packet per frame, presentation
    times evenly spaced, decode times increasing, a keyframe first."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        packets = [(p.pts, p.dts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None]
    ticks = sorted(pts for pts, _, _ in packets)
    steps = {b - a for a, b in pairwise(ticks)}
    dts_ok = all(a[1] < b[1] for a, b in pairwise(packets))
    keys = sum(1 for *_, key in packets if key)
    return {"frames": len(packets), "pts_even": len(steps) <= 1, "dts_increasing": dts_ok,
            "keyframes": keys, "ok": len(steps) <= 1 and dts_ok and bool(packets and packets[0][2])}  # fmt: skip


def parse_variant(spec: str, base: EncodeOptions) -> EncodeOptions:
    """`segments=4,tune=fastdecode` -> `base` with those fields replaced."""
    fields: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in ("crf", "preset", "tune", "bframes", "threads", "segments"):
            raise SystemExit(f"--variants: unknown field {key!r} in {spec!r}")
        fields[key] = value if key in ("preset", "tune") else int(value)
    return dataclasses.replace(base, **fields)


def encode_new(yuv: torch.Tensor, path: Path, width: int, options: EncodeOptions, repeats: int) -> dict[str, Any]:
    seconds, size, cpu = timed(lambda: write_mp4_yuv(yuv, path, 24.0, width=width, options=options), repeats)
    return {"s": round(seconds, 4), "cpu_s": round(cpu, 3), "bytes": size,
            "segments": options.segment_count(int(yuv.shape[0])), "check": stream_check(path)}  # fmt: skip


def one_case(clip: str, width: int, height: int, args: argparse.Namespace, options: EncodeOptions,
             workdir: Path) -> dict[str, Any]:  # fmt: skip
    frames = noise_clip(args.frames, width, height) if clip == "noise" else content_clip(args.frames, width, height)
    old_s, old_bytes, old_cpu = timed(lambda: old_encode(frames, workdir / "old.mp4", crf=args.crf), args.repeats)
    convert_s, yuv, _ = timed(lambda: to_yuv420p(frames), args.repeats)  # (swscale on the CPU, as a CPU rank does)
    handoff_s = pageable_s = None
    if args.device == "cuda":  # what the fleet pays instead of the encode: convert there, one copy out
        on_device = frames.cuda()

        def handoff() -> torch.Tensor:
            out = shared_host_copy(rgb_to_yuv420p(on_device))
            torch.cuda.synchronize()
            return out

        def pageable() -> torch.Tensor:
            out = shared_host_copy(rgb_to_yuv420p(on_device), pinned=False)
            torch.cuda.synchronize()
            return out

        handoff()  # (warm-up: the first call pays CUDA's lazy initialisation)
        handoff_s, from_device, _ = timed(handoff, args.repeats)
        pageable_s, from_pageable, _ = timed(pageable, args.repeats)
        assert torch.equal(from_device, rgb_to_yuv420p(frames)), "the device conversion differs from torch's on CPU"
        assert torch.equal(from_pageable, from_device), "the page-locked copy differs from the pageable one"
    before = dataclasses.replace(options, tune="", bframes=-1, segments=1)  # (the worker's settings until now)
    skipped = {"s": None, "cpu_s": None, "bytes": None}
    current = encode_new(yuv, workdir / "current.mp4", width, before, args.repeats) if args.current else skipped
    new = encode_new(yuv, workdir / "new.mp4", width, options, args.repeats)
    variants = {spec: encode_new(yuv, workdir / "variant.mp4", width, parse_variant(spec, options), args.repeats)
                for spec in args.variants}  # fmt: skip
    for result in (new, *([current] if args.current else []), *variants.values()):
        result["speedup"] = round(old_s / result["s"], 3) if result["s"] else None
        result["bytes_ratio"] = round(result["bytes"] / old_bytes, 4) if old_bytes else None
    return {
        "kind": "case",
        "clip": clip,
        "size": f"{width}x{height}",
        "frames": args.frames,
        "old_s": round(old_s, 4),
        "old_cpu_s": round(old_cpu, 3),
        "old_bytes": old_bytes,
        "current_s": current["s"],
        "current_cpu_s": current["cpu_s"],
        "current_bytes": current["bytes"],
        "new_encode_s": new["s"],
        "new_cpu_s": new["cpu_s"],
        "new_bytes": new["bytes"],
        "new_segments": new["segments"],
        "new_check": new["check"],
        "new_convert_cpu_s": round(convert_s, 4),
        "new_total_cpu_s": round(new["s"] + convert_s, 4),
        "fleet_handoff_cuda_s": None if handoff_s is None else round(handoff_s, 4),
        "fleet_handoff_pageable_cuda_s": None if pageable_s is None else round(pageable_s, 4),
        "speedup_encode": new["speedup"],
        "speedup_current": current.get("speedup"),
        "speedup_new_over_current": round(current["s"] / new["s"], 3) if new["s"] and current["s"] else None,
        "speedup_with_cpu_convert": round(old_s / (new["s"] + convert_s), 3),
        "bytes_ratio": new["bytes_ratio"],
        "current_bytes_ratio": current.get("bytes_ratio"),
        "variants": variants,
    }


def table(cases: list[dict[str, Any]]) -> list[str]:
    """Seconds (CPU seconds), bytes ratio to the old path and speed-up, per case and path: what a person reads."""
    out = []
    for c in cases:
        paths = {"old": (c["old_s"], c["old_cpu_s"], 1.0), "current": (c["current_s"], c["current_cpu_s"],
                 c["current_bytes_ratio"]), "new": (c["new_encode_s"], c["new_cpu_s"], c["bytes_ratio"])}  # fmt: skip
        if c["current_s"] is None:
            del paths["current"]
        paths.update({k: (v["s"], v["cpu_s"], v["bytes_ratio"]) for k, v in c["variants"].items()})
        cells = [f"{k} {s:.3f}s ({cpu:.1f} cpu) bytes x{ratio:.3f}: {c['old_s'] / s:.2f}x" for k, (s, cpu, ratio) in
                 paths.items()]  # fmt: skip
        out.append(f"TABLE {c['clip']} {c['size']} handoff {c['fleet_handoff_cuda_s']}/"
                   f"{c['fleet_handoff_pageable_cuda_s']} | " + " | ".join(cells))  # fmt: skip
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="9 frames at 256x160, one repeat (seconds, for CI)")
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--sizes", default="768x512,1536x1024")
    ap.add_argument("--clips", default="noise,content")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--crf", type=int, default=EncodeOptions.crf)
    ap.add_argument("--preset", default=EncodeOptions.preset)
    ap.add_argument("--tune", default=EncodeOptions.tune, help="x264 tune of the new path ('': none)")
    ap.add_argument("--bframes", type=int, default=EncodeOptions.bframes, help="x264 B-frames (-1: the preset's)")
    ap.add_argument("--threads", type=int, default=0, help="cores the new path may use (0: every core)")
    ap.add_argument("--segments", type=int, default=EncodeOptions.segments,
                    help="parallel x264 runs of the new path (0: one per thread, runs of >= 16 frames)")  # fmt: skip
    ap.add_argument("--no-current", dest="current", action="store_false", help="skip the current path")
    ap.add_argument("--variants", default="", help="more settings of the new path, ':'-separated (see above)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="also time the fleet's hand-off on CUDA (auto: if there is one)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    ap.add_argument("--table", action="store_true",
                    help="short lines per case, the summary without its cases (--out keeps the JSON)")  # fmt: skip
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(":") if v] if "=" in args.variants else []
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.frames, args.sizes, args.repeats = 9, "256x160", 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = EncodeOptions(crf=args.crf, preset=args.preset, tune=args.tune, bframes=args.bframes,
                            threads=args.threads, segments=args.segments)  # fmt: skip
    for spec in args.variants:
        parse_variant(spec, options)  # (a typo fails before the first clip, not after)
    cases = []
    out = args.out.open("w") if args.out is not None else None  # (line by line: a run cut short keeps its cases)

    def emit(line: str, brief: str | None = None) -> None:
        print(brief if args.table and brief is not None else line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    with tempfile.TemporaryDirectory(prefix="bench-media-") as tmp:
        for size in args.sizes.split(","):
            width, height = (int(v) for v in size.lower().split("x"))
            for clip in args.clips.split(","):
                case = one_case(clip.strip(), width, height, args, options, Path(tmp))
                cases.append(case)
                emit(json.dumps(case), table([case])[0])
    target = next((c for c in cases if c["clip"] == "noise" and c["size"] == "1536x1024"), None)
    summary = {
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "threads": options.thread_count,
        "segments_at_121_frames": options.segment_count(121),
        "threads_per_segment_at_121_frames": options.threads_per_segment(options.segment_count(121)),
        "crf": options.crf,
        "preset": options.preset,
        "tune": options.tune,
        "bframes": options.bframes,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "target": None if target is None else {
            "case": "noise 1536x1024", "speedup_new_over_old": target["speedup_encode"], "goal": 3.0,
            "met": bool(target["speedup_encode"] and target["speedup_encode"] >= 3.0),
            "new_s": target["new_encode_s"], "old_s": target["old_s"], "bytes_ratio": target["bytes_ratio"]},
        "all_new_files_ok": all(c["new_check"]["ok"] and c["new_check"]["frames"] == c["frames"] for c in cases),
        "cases": cases,
    }  # fmt: skip
    brief = {k: v for k, v in summary.items() if k != "cases"}
    emit("SUMMARY " + json.dumps(summary), "SUMMARY " + json.dumps(brief))
    if out is not None:
        out.close()
    return 0 if summary["all_new_files_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
