"""Stage-2 audio of the two-stage runner: re-denoise it under TDP (what the runner does), or keep stage 1's?

The single-device reference refines the audio latent in stage 2 together with the video (re-noised to the
first stage-2 sigma, denoised with the full video in view). Our stage 2 runs tiled data parallel (TDP):
each tile's forward sees only its part of the video, and the audio prediction is the average over tiles.
This measures, on the same job and the same stage-1 result, three stage-2 variants:

- `reference`: one tile (the whole video in view), audio re-denoised: what the single-device reference does;
- `tdp_redenoise`: `--tiles` tiles, audio re-denoised from the tile-averaged predictions (the runner);
- `tdp_fixed`: `--tiles` tiles, stage 1's audio kept as fixed conditioning (the multi-GPU reference's way).

and reports each variant's final audio latent distance from the reference (relative L2) and its stage-2
wall time (median over the seeds, after one warm-up job per variant). With synthetic weights this measures
the mechanism (how far a tile-averaged refinement lands from the full-view refinement, and what it costs),
not how the audio sounds.

Usage:
  .venv/bin/python bench/stage2_audio.py --seeds 3 --tiles 2            # tiny checkpoints, CPU
  python bench/stage2_audio.py --weights /dev/shm/ltx2 --device cuda:0 --width 768 --height 512 --frames 121

JSON lines per (seed, variant), then `SUMMARY {...}` with the mean distances and stage-2 times.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from ltx_mgpu.runners.common.local import LocalRunner
from ltx_mgpu.runners.ltx2.denoise import STAGE2_TDP_SIGMAS
from ltx_mgpu.runners.ltx2.two_stage import Ltx2TwoStageRunner


class _Probe(Ltx2TwoStageRunner):
    """The two-stage runner with a switch for stage-2 audio and a record of stage 2's outputs."""

    redenoise = True
    last: tuple[torch.Tensor, torch.Tensor] | None = None

    def _stage2_audio(self, job: Any, tools: Any, latent: torch.Tensor, sigma0: float) -> Any:
        if self.redenoise:
            return super()._stage2_audio(job, tools, latent, sigma0)
        return self._state(tools, job, noise_scale=0.0, initial_latent=latent, frozen=True)  # fixed conditioning

    def _stage2(self, *args: Any) -> Any:
        self.last = yield from super()._stage2(*args)
        return self.last


def _run(local: LocalRunner, redenoise: bool, job: dict[str, Any]) -> tuple[torch.Tensor, float]:
    local.runner.redenoise = redenoise
    events = local.run(**job)
    output = next(e for e in events if e.get("type") == "output")
    return local.runner.last[1].float().cpu(), float(output["timings_s"]["stage2"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=None, help="a synthetic or real checkpoint directory (default: tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tiles", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--height", type=int, default=192)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.weights:
        from ltx_mgpu.runners.ltx2.synthetic import Ltx2Files

        files, extra = Ltx2Files.under(args.weights), {}
    else:
        from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

        files, extra = ensure_tiny_ltx2(), {"prompt_tokens": 128, "tdp_overlap": 1}
    setup = {**files.setup_kwargs(), **extra, "stage2_sigmas": list(STAGE2_TDP_SIGMAS)}
    rows: dict[str, list[dict[str, float]]] = {"reference": [], "tdp_redenoise": [], "tdp_fixed": []}
    runs = {"reference": (1, True), "tdp_redenoise": (args.tiles, True), "tdp_fixed": (args.tiles, False)}
    results: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}
    for name, (tiles, redenoise) in runs.items():
        with LocalRunner(_Probe, device=args.device) as local:
            local.start(**setup, tdp_tiles=tiles)
            local.runner.redenoise = redenoise
            warm = {"output_path": "/tmp/stage2_audio_warmup.mp4", "prompt": "warm-up", "width": args.width,
                    "height": args.height, "num_frames": args.frames, "steps": 2, "audio": False}  # fmt: skip
            local.run(**warm)
            for seed in range(args.seeds):
                job = {"output_path": f"/tmp/stage2_audio_{name}_{seed}.mp4", "prompt": "a drummer on a beach",
                       "seed": seed, "width": args.width, "height": args.height, "num_frames": args.frames,
                       "frame_rate": 24.0, "steps": args.steps, "audio": False}  # fmt: skip
                results[(name, seed)] = _run(local, redenoise, job)
    for seed in range(args.seeds):
        ref, _ = results[("reference", seed)]
        for name in runs:
            audio, seconds = results[(name, seed)]
            rel = ((audio - ref).norm() / ref.norm()).item()
            row = {"seed": seed, "variant": name, "audio_rel_l2_vs_reference": round(rel, 4), "stage2_s": seconds}
            rows[name].append(row)
            print(json.dumps(row), flush=True)
    summary = {
        "weights": args.weights or "tiny",
        "device": args.device,
        "tiles": args.tiles,
        "request": f"{args.width}x{args.height}x{args.frames}",
        "stage2_sigmas": list(STAGE2_TDP_SIGMAS),
    }
    for name, rs in rows.items():
        summary[f"{name}_audio_rel_l2"] = round(statistics.mean(r["audio_rel_l2_vs_reference"] for r in rs), 4)
        summary[f"{name}_stage2_s"] = round(statistics.median(r["stage2_s"] for r in rs), 3)
    summary["redenoise_over_fixed_stage2_time"] = round(
        summary["tdp_redenoise_stage2_s"] / summary["tdp_fixed_stage2_s"], 3
    )
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
