"""A runnable controller example: a CPU fleet of two ranks streaming one job.

Run: .venv/bin/python docs/examples/controller_example.py
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ltx_mgpu import MGPUController, MGPURunner, SymmetricRunnerError


class SumRunner(MGPURunner):
    def setup(self, *, scale: float) -> None:
        self.scale = scale  # load models here: runs once per rank

    def __call__(self, *, x: torch.Tensor, steps: int = 3) -> Iterator[dict]:
        if steps < 1:
            raise ValueError("steps must be >= 1")  # same on every rank → SymmetricRunnerError, fleet lives
        for step in range(steps):
            self.raise_if_cancelled()  # every rank takes the same decision at the same call
            total = (x * self.scale).sum().reshape(1)
            dist.all_reduce(total, group=self.groups.transformer_group)
            if self.is_driver:
                yield {"step": step, "total": float(total.item())}
        return self.rank


if __name__ == "__main__":
    controller = MGPUController(SumRunner, devices=["cpu", "cpu"])  # or devices=[0, 1] on GPUs
    controller.start(timeout=120, scale=2.0)
    try:
        stream = controller.stream(x=torch.ones(4), steps=3)
        try:
            for event in stream:
                print("event", event)
        finally:
            stream.drain()
        print("per-rank return values:", stream.result)
        try:
            list(controller.stream(x=torch.ones(4), steps=0))
        except SymmetricRunnerError as err:
            print("rejected on every rank:", err, "| fleet alive:", controller.is_alive)
    finally:
        controller.shutdown()
