"""`NoopRunner`: a runner that renders nothing, for measuring the service around the fleet.

It accepts every `RenderRequest` field, yields the same event shapes as a real pipeline (stage, one
progress event per step, output) and writes `output_bytes` pseudo-random bytes to `output_path` on the
driver rank. `bench/service.py` uses it for jobs/s and latency numbers; operators can use it to smoke-test
a deployment (Redis, storage, events) without loading a model (`LTX_RUNNER=noop`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..control.events import Stage, output_event, progress_event, stage_event
from ..control.runner import MGPURunner

__all__ = ["NoopRunner"]


class NoopRunner(MGPURunner):
    """See the module docstring. `setup(output_bytes=…, step_delay_s=…)` configures it per fleet."""

    def setup(self, *, output_bytes: int = 4096, step_delay_s: float = 0.0) -> None:
        self.output_bytes = int(output_bytes)
        self.step_delay_s = float(step_delay_s)

    def __call__(
        self,
        *,
        output_path: str,
        prompt: str = "",
        steps: int = 1,
        width: int = 32,
        height: int = 32,
        num_frames: int = 1,
        frame_rate: float = 24.0,
        **_ignored: Any,
    ) -> Iterator[dict[str, Any]]:
        if self.is_driver:
            yield stage_event(Stage.DENOISE)
        for step in range(1, steps + 1):
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            self.raise_if_cancelled()
            if self.is_driver:
                yield progress_event(Stage.DENOISE, step, steps, t_yield=time.time())
        if self.is_driver:
            path = Path(output_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as fh:
                remaining = self.output_bytes
                block = os.urandom(min(remaining, 1 << 20)) if remaining else b""
                while remaining > 0:
                    fh.write(block[:remaining])
                    remaining -= len(block[:remaining])
            yield output_event(
                str(path),
                frames=num_frames,
                fps=frame_rate,
                width=width,
                height=height,
                size_bytes=self.output_bytes,
                content_type="video/mp4",
            )
