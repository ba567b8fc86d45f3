"""What a failure says outside the worker's log: one line and an error id, never a traceback.

Why: a dead rank's full Python traceback holds file paths, local values and the request's text in exception
messages, and the job's error, the fleet's `last_failure` in every worker's health snapshot (which every
tenant may read) and `/healthz` are read outside the worker. So a message with more than one line (or longer
than `_MAX_LINE`) is logged once in full at ERROR with a fresh error id, and what reaches Redis and the probes
is one line: its first line, what each rank died of (exit code and exception type,
no message) and the id to look up in the log (`grep <id>`).
"""

from __future__ import annotations

import logging
import re
import secrets

__all__ = ["public_message"]

log = logging.getLogger("worker.errors")

_MAX_LINE = 300
_RANK = re.compile(r"^\s*rank (\d+) \(pid \d+\) exit (-?\d+|None):\s*$")
_EXC = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def public_message(message: str, *, context: str = "") -> tuple[str, str | None]:
    """(one line fit for Redis, health and tenants; the error id under which the worker log holds the
    whole message, or None when `message` was one short line already)."""
    text = str(message)
    if "\n" not in text.strip() and len(text) <= _MAX_LINE:
        return text.strip(), None
    error_id = "err-" + secrets.token_hex(6)
    log.error("error %s%s:\n%s", error_id, f" ({context})" if context else "", text)
    lines = [line for line in text.splitlines() if line.strip()]
    summary = lines[0].strip()[:160] if lines else "error"
    ranks: list[str] = []
    current: str | None = None
    kind: str | None = None
    for line in lines[1:]:
        match = _RANK.match(line)
        if match:
            if current is not None:
                ranks.append(current + (f" ({kind})" if kind else ""))
            current, kind = f"rank {match.group(1)} exit {match.group(2)}", None
            continue
        exc = _EXC.match(line.strip())
        if exc and (exc.group(1).endswith(("Error", "Exception", "Exit", "Interrupt", "Failure", "Warning"))):
            kind = exc.group(1).rsplit(".", 1)[-1]
    if current is not None:
        ranks.append(current + (f" ({kind})" if kind else ""))
    elif kind:
        ranks.append(kind)
    detail = f" {'; '.join(ranks)}" if ranks else ""
    return f"{summary}{detail} [error id {error_id}: details in the worker log]"[: _MAX_LINE + 80], error_id
