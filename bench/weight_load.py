"""Weight load to one GPU: ltx-core's safetensors loader against `fastload.StagedSafetensorsLoader`, same
files, same run, alternating which goes first (`--rounds` of each). What the cold start's weight-load phase
spends per rank: the 19B transformer from the monolith, and Gemma 3 12B from its shards.

    python bench/weight_load.py --weights /dev/shm/ltx2-full   # written by ltx_mgpu.runners.ltx2.synthetic
    python bench/weight_load.py --weights DIR --components transformer  # the transformer only

One JSON line per load (component, loader, seconds, GB, GB/s), then `SUMMARY {...}` with the median seconds
per component and loader and the ratio ltx-core / staged (above 1: the staged loader is faster). Builds the
models through the runners' own builders (the same key ops), then frees them before the next load.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu.runners.ltx2.components import transformer_builder
from ltx_mgpu.runners.ltx2.synthetic import Ltx2Files
from ltx_mgpu.runners.ltx2.text import gemma_builder


def builders(files: Ltx2Files, component: str) -> dict[str, Any]:
    """{loader name: builder} for one component: the runners' builder (staged) and the same with ltx-core's."""
    from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader

    if component == "transformer":
        staged = transformer_builder(str(files.checkpoint))
        return {"staged": staged, "ltx-core": replace(staged, model_loader=SafetensorsModelStateDictLoader())}
    staged = gemma_builder(str(files.gemma_root))
    plain = replace(staged, model_loader=replace(staged.model_loader, weight_loader=None))
    return {"staged": staged, "ltx-core": plain}


def one_load(builder: Any, device: torch.device) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    model = builder.build(device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    gb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return seconds, gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True, help="a checkpoint directory (synthetic layout)")
    ap.add_argument("--components", default="transformer,gemma")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    device = torch.device(args.device)
    files = Ltx2Files.under(args.weights)
    times: dict[str, dict[str, list[float]]] = {}
    for component in args.components.split(","):
        pair = builders(files, component)
        times[component] = {name: [] for name in pair}
        for r in range(args.rounds):
            order = list(pair) if r % 2 == 0 else list(reversed(pair))
            for name in order:
                seconds, gb = one_load(pair[name], device)
                times[component][name].append(seconds)
                print(json.dumps({"component": component, "loader": name, "round": r, "seconds": round(seconds, 3),
                                  "gb": round(gb, 2), "gb_per_s": round(gb / seconds, 2)}), flush=True)  # fmt: skip
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    for component, per in times.items():
        med = {name: statistics.median(v) for name, v in per.items()}
        summary[component] = {"median_s": {k: round(v, 3) for k, v in med.items()},
                              "ltx-core/staged": round(med["ltx-core"] / med["staged"], 2)}  # fmt: skip
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
