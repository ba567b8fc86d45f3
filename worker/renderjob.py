"""`RenderJob`: the RQ job class of render workers, hardened against what anyone with Redis access can push.

Found by the chaos suite (tests/chaos): a plain RQ worker executes *any* importable function named in a
job hash (a hand-written `rq:job:<id>` naming `os.makedirs` ran it), and a hash RQ cannot parse
(`created_at: "yesterday"`) or whose meta is not JSON made the worker process quit with its warm fleet
(an unparseable meta even crashed the next worker's registry cleanup). So:

- only `worker.keys.RENDER_FUNC` is executed; any other function, or a job id `worker.keys.check_job_id`
  refuses (too long for the spool: issue 19), fails the job with `RefusedJob`;
- a meta field that is not JSON is kept as text (`{"unserialized": "..."}`) so the job can be saved and failed;
- `worker.rqcompat.fail_unreadable()` records a job that cannot even be loaded as failed (hash status,
  failed registry, expiry), so a dequeue never kills the worker and the job never sits in `queued` forever.
"""

from __future__ import annotations

import logging
from typing import Any

from rq.job import Job

from .keys import RENDER_FUNC, check_job_id

__all__ = ["RefusedJob", "RenderJob"]

log = logging.getLogger("worker.rq")


class RefusedJob(RuntimeError):
    """The job names a function other than the render function: never executed."""


class RenderJob(Job):
    """See the module docstring."""

    def restore(self, raw_data: Any) -> Any:
        out = super().restore(raw_data)
        meta = self.meta
        if isinstance(meta, dict) and isinstance(meta.get("unserialized"), bytes):
            self.meta = {"unserialized": meta["unserialized"].decode("utf-8", "replace")}
        return out

    def _execute(self) -> Any:
        if self.func_name != RENDER_FUNC:
            raise RefusedJob(f"this worker only runs {RENDER_FUNC}; refusing to run {self.func_name!r}")
        try:
            check_job_id(self.id)  # (RQ checks only the characters; a long id broke the spool, issue 19)
        except ValueError as exc:
            raise RefusedJob(str(exc)) from None
        return super()._execute()
