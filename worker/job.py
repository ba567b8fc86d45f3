"""The RQ job function producers enqueue: `worker.job.render` (see `ltx_contract.keys.RENDER_FUNC`).

RQ resolves it by its dotted path inside the worker process, where `worker.runtime.process` has installed the
process's `RenderService` (one warm fleet). Enqueued elsewhere, e.g. by a plain forking RQ worker, it
fails loudly instead of loading a model per job.
"""

from __future__ import annotations

from typing import Any

from worker.render.service import RenderService
from worker.rq.record import current_record

__all__ = ["install_service", "render"]

_service: RenderService | None = None


def install_service(service: RenderService | None) -> None:
    """Make `service` the one `render()` uses in this process (set by `worker.runtime.process`)."""
    global _service
    _service = service


def render(request: dict[str, Any]) -> dict[str, Any]:
    """Render one `RenderRequest` (a JSON object) on this process's fleet; return the result JSON."""
    if _service is None:
        raise RuntimeError(
            "worker.job.render must run inside an ltx-worker process (FleetWorker); "
            "it was picked up by a worker without a fleet"
        )
    record = current_record()
    if record is None:
        raise RuntimeError("worker.job.render called outside an RQ job")
    return _service.run_job(record, request)
