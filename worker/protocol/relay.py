"""`EventRelay`: the events of a running job, written into its Redis Stream with a summary in the RQ job meta.

How one event is written (one pipeline, exactly once, retried through Redis outages) is the contract's
`ltx_contract.event_stream.EventWriter`, which the producer uses too (a cancelled job that never ran). What a
running job adds is here: a `stage` event starts the summary's stage over, and a `progress` event sets `step`,
`total`, `percent` and an `eta_s` from the step rate observed in the stage (both also go into the event).
"""

from __future__ import annotations

import time
from typing import Any

from ltx_contract.event_stream import EventWriter
from ltx_contract.states import EventType

__all__ = ["EventRelay"]


class EventRelay(EventWriter):
    """Writes events of one job execution: the writer's, plus stage and progress summaries (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stage_started: dict[str, tuple[float, int]] = {}  # stage -> (monotonic at first step, step)

    def event_summary(self, etype: str, data: dict[str, Any]) -> dict[str, Any]:
        if etype == EventType.PROGRESS.value:
            changes = self._progress_summary(data)
            data["percent"], data["eta_s"] = changes["percent"], changes["eta_s"]
            return changes
        if etype == EventType.STAGE.value:
            return {"stage": data.get("stage"), "step": None, "total": None, "percent": None, "eta_s": None}
        return {}

    def _progress_summary(self, data: dict[str, Any]) -> dict[str, Any]:
        stage = data.get("stage")
        step = int(data.get("step") or 0)
        total = int(data.get("total") or 0)
        now = time.monotonic()
        first = self._stage_started.get(stage) if isinstance(stage, str) else None
        if isinstance(stage, str) and (first is None or step < first[1]):
            self._stage_started[stage] = first = (now, step)
        percent = round(100.0 * step / total, 2) if total > 0 else None
        eta = None
        if first is not None and total > 0 and step > first[1]:
            rate = (now - first[0]) / (step - first[1])  # seconds per step, observed in this stage
            eta = round(rate * (total - step), 3)
        return {"stage": stage, "step": step, "total": total, "percent": percent, "eta_s": eta}
