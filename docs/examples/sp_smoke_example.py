"""Sequence parallelism end to end on CPU: the smoke runner (real LTX-2 architecture, tiny, random
weights) renders the same video on one rank and on two ranks (tokens sharded, heads exchanged over gloo),
and the frames are compared.

Run: .venv/bin/python docs/examples/sp_smoke_example.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ltx_mgpu import MGPUController
from ltx_mgpu.media.mp4_read import read_mp4
from ltx_mgpu.runners.smoke import SmokeRunner

JOB = {"prompt": "a lighthouse at dusk", "seed": 3, "width": 128, "height": 96, "num_frames": 17, "steps": 2}

if __name__ == "__main__":
    out_dir = Path(tempfile.mkdtemp(prefix="sp-example-"))
    frames = {}
    for world in (1, 2):
        controller = MGPUController(SmokeRunner, devices=["cpu"] * world)
        controller.start(timeout=300, crf=0)  # crf=0: lossless, so the comparison sees the model's frames
        try:
            path = out_dir / f"world{world}.mp4"
            for event in controller.stream(timeout=300, output_path=str(path), **JOB):
                if event["type"] in ("stage", "output"):
                    print(f"world {world}:", event)
            frames[world], _ = read_mp4(path)
        finally:
            controller.shutdown()
    diff = (frames[1].float() - frames[2].float()).abs()
    print(f"world 1 vs world 2: max pixel difference {diff.max().item():.0f} (of 255)")
