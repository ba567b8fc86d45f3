"""Structured logs: one JSON object per line with the worker's group and name and the current job id.

The job id lives in a context variable set by the worker around each job, so every log line emitted while
a job runs (ours, RQ's, boto's) carries it without passing it around. `text` format is for terminals.
The fleet's rank processes log the same way (`rank_logging`, given to `MGPUController`): a runner's warning on
a rank (synthetic weights, a CUDA graph that stayed eager) was a plain-text line in the worker's JSON log.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["bind_job", "current_job_id", "event_text", "rank_logging", "setup_logging"]

_job_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("ltx_job_id", default=None)
_static: dict[str, str] = {}


def current_job_id() -> str | None:
    return _job_id.get()


@contextmanager
def bind_job(job_id: str) -> Iterator[None]:
    """Tag every log record emitted inside the block with `job_id`."""
    token = _job_id.set(job_id)
    try:
        yield
    finally:
        _job_id.reset(token)


def event_text(event: dict[str, object]) -> str:
    """An event dict as `action key=value ...` for a log line: `%s` of the dict printed enum reprs
    (`{'type': <EventType.FLEET: 'fleet'>, ...}`) and quoted every string."""
    fields = " ".join(
        f"{k}={json.dumps(v, default=str) if isinstance(v, dict | list) else v}"
        for k, v in event.items()
        if k not in ("type", "action")
    )
    return f"{event.get('action', event.get('type'))} {fields}".strip()


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.job_id = _job_id.get()
        for key, value in _static.items():
            setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "group", "worker", "job_id", "exc"?}` per line."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "group": getattr(record, "group", None),
            "worker": getattr(record, "worker", None),
            "job_id": getattr(record, "job_id", None),
            "pid": record.process,
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        job = getattr(record, "job_id", None)
        group = getattr(record, "group", None)
        tags = " ".join(t for t in (f"[{group}]" if group else "", f"job={job}" if job else "") if t)
        text = f"{stamp} {record.levelname[0]} {record.name}: {tags + ' ' if tags else ''}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str = "INFO", fmt: str = "json", **static: str) -> None:
    """Configure the root logger once per process (RQ then keeps its hands off: it only adds handlers
    when none exist). `static` fields (group=…, worker=…) go on every record."""
    _static.update({k: v for k, v in static.items() if v is not None})
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_ltx", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._ltx = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def rank_logging(level: str, fmt: str, group: str, worker: str, rank: int) -> None:
    """In a rank process of this worker's fleet (`MGPUController(rank_logging=partial(rank_logging, level,
    fmt, group, worker))`, called with the rank): the worker's format, level, group and name; `pid` tells
    the ranks apart."""
    setup_logging(level, fmt, group=group, worker=worker)
