"""Evidence of a job the chaos checker flagged (lost, duplicated, corrupt, or ended otherwise than planned),
written before the stack is torn down, so one occurrence is enough to diagnose.

Why: a soak under heavy load lost one job once and the rerun was clean; all that was left was the report
line. Now every flagged job gets a folder `<run>/evidence/<job id>/`, named in the report's line:

| file                  | what                                                                              |
|-----------------------|-----------------------------------------------------------------------------------|
| `why.txt`             | the checker's lines for this job                                                  |
| `hash.json`           | the RQ job hash (`data` decompressed when it is zlib JSON) and every job key's TTL |
| `events.jsonl`        | the job's event stream, entry ids included                                        |
| `results.jsonl`       | RQ's results stream for the job                                                    |
| `registries.json`     | every `rq:*` list, set or sorted set that holds the id (queue, wip, failed, ...)   |
| `exec_log.jsonl`      | the chaos runner's execution log (every rank's starts, the driver's end)          |
| `timeline.jsonl`      | every fault and run event (wall-clock `t`), `near`: within 30 s of the job's life  |
| `worker_log_job.txt`  | the supervisor log's lines that name the job (workers log JSON with `job_id`)      |
| `worker_log_tail.txt` | the supervisor log's last 400 lines                                               |
| `redis_log_tail.txt`  | the Redis server log's tail (restarts, AOF loading)                                |

Reading Redis is best effort: a run that broke may have no Redis left; what could not be read says why.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path
from typing import Any

from ltx_contract.keys import events_key
from tests.chaos.runner import read_exec_log

__all__ = ["keep_evidence"]

NEAR_S = 30.0
_TAIL_LINES = 400


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return {"bytes": len(value), "head": value[:64].hex()}
    return value


def _job_hash(conn: Any, job_id: str) -> dict[str, Any]:
    raw = conn.hgetall(f"rq:job:{job_id}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _text(key)
        if name == "data" and isinstance(value, bytes):
            with contextlib.suppress(zlib.error, UnicodeDecodeError, ValueError):
                out["data"] = json.loads(zlib.decompress(value).decode())
                continue
        if name == "meta" and isinstance(value, bytes):
            with contextlib.suppress(UnicodeDecodeError, ValueError):
                out["meta"] = json.loads(value.decode())
                continue
        out[name] = _text(value)
    ttls = {}
    for key in (f"rq:job:{job_id}", events_key(job_id), f"rq:results:{job_id}"):
        ttls[key] = conn.ttl(key)  # (-2: no such key, -1: never expires)
    return {"exists": bool(raw), "fields": out, "ttl": ttls}


def _stream(conn: Any, key: str) -> list[dict[str, Any]]:
    rows = []
    for entry_id, fields in conn.xrange(key):
        row: dict[str, Any] = {"id": _text(entry_id)}
        for k, v in fields.items():
            value = _text(v)
            if isinstance(value, str):
                with contextlib.suppress(ValueError):
                    value = json.loads(value)
            row[str(_text(k))] = value
        rows.append(row)
    return rows


def _registries(conn: Any, job_id: str) -> dict[str, Any]:
    """Every `rq:*` collection that names the job, with its score (a registry's expiry) or list index."""
    found: dict[str, Any] = {}
    for key in conn.scan_iter(match="rq:*", count=1000):
        kind = _text(conn.type(key))
        name = _text(key)
        if kind == "zset":
            score = conn.zscore(key, job_id)
            if score is not None:
                found[name] = {"type": "zset", "score": score}
        elif kind == "list":
            index = conn.lpos(key, job_id)
            if index is not None:
                found[name] = {"type": "list", "index": index, "length": conn.llen(key)}
        elif kind == "set" and conn.sismember(key, job_id):
            found[name] = {"type": "set"}
    return found


def _tail(path: Path | None, lines: int = _TAIL_LINES) -> str:
    if path is None or not Path(path).exists():
        return f"(no file at {path})\n"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) + "\n"


def _write(path: Path, what: Any) -> None:
    if isinstance(what, str):
        path.write_text(what)
    elif isinstance(what, list):
        path.write_text("".join(json.dumps(row, default=str) + "\n" for row in what))
    else:
        path.write_text(json.dumps(what, default=str, indent=1) + "\n")


def keep_evidence(folder: Path, conn: Any, job_id: str, *, why: list[str], exec_log_dir: Path,
                  timeline: list[dict[str, Any]], worker_log: Path | None, redis_log: Path | None,
                  submitted_at: float | None = None) -> Path:  # fmt: skip
    """Write the evidence of `job_id` into `folder/<job_id>/` and return that folder. Never raises for
    what it cannot read (each file then says why); it must not hide the finding it documents."""
    out = Path(folder) / job_id
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "why.txt", "\n".join(why) + "\n")
    readers = {
        "hash.json": lambda: _job_hash(conn, job_id),
        "events.jsonl": lambda: _stream(conn, events_key(job_id)),
        "results.jsonl": lambda: _stream(conn, f"rq:results:{job_id}"),
        "registries.json": lambda: _registries(conn, job_id),
        "exec_log.jsonl": lambda: read_exec_log(exec_log_dir, job_id),
    }
    got: dict[str, Any] = {}
    for name, read in readers.items():
        try:
            got[name] = read()
        except Exception as exc:  # (a broken run: Redis gone, a log half-written) -- say so, keep going
            got[name] = f"could not read: {type(exc).__name__}: {exc}\n"
        _write(out / name, got[name])
    own = [e.get("ts") for e in got["events.jsonl"]] if isinstance(got["events.jsonl"], list) else []
    own += [r.get("t") for r in got["exec_log.jsonl"]] if isinstance(got["exec_log.jsonl"], list) else []
    times = [float(t) for t in [*own, submitted_at] if isinstance(t, int | float)]
    lo, hi = (min(times) - NEAR_S, max(times) + NEAR_S) if times else (float("-inf"), float("inf"))
    _write(out / "timeline.jsonl", [{**e, "near": lo <= float(e.get("t", 0)) <= hi} for e in timeline])
    mentions = []
    if worker_log is not None and Path(worker_log).exists():
        with Path(worker_log).open(errors="replace") as f:
            mentions = [line.rstrip("\n") for line in f if job_id in line]
    _write(out / "worker_log_job.txt", "\n".join(mentions[-2000:]) + "\n")
    _write(out / "worker_log_tail.txt", _tail(worker_log))
    _write(out / "redis_log_tail.txt", _tail(redis_log, 200))
    return out
