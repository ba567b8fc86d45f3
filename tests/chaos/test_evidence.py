"""The chaos runs keep the evidence of every job they flag: the writer against a real Redis (fast), and a
short run with a planted loss (one job taken out of its queue mid-run) whose report must name the folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ltx_contract.keys import EVENT_FIELD_DATA, EVENT_FIELD_TYPE, events_key
from tests.chaos.engine import run_chaos
from tests.chaos.evidence import keep_evidence
from tests.chaos.runner import append_record
from tests.support.workers import enqueue

pytestmark = pytest.mark.timeout(600)


def _read(folder: Path, name: str) -> Any:
    text = (folder / name).read_text()
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text) if name.endswith(".json") else text


def test_evidence_of_one_job(redis_client: Any, unique_name: str, tmp_path: Path) -> None:
    queue = f"q-{unique_name}"
    job = enqueue(redis_client, queue, {"prompt": "evidence"})
    job.meta["state"] = "rendering"
    job.save_meta()
    redis_client.xadd(events_key(job.id), {EVENT_FIELD_TYPE: "state", EVENT_FIELD_DATA: json.dumps(
        {"type": "state", "state": "started", "ts": 1000.0})})  # fmt: skip
    redis_client.zadd(f"rq:failed:{queue}", {job.id: 12345})
    exec_dir = tmp_path / "exec"
    exec_dir.mkdir()
    append_record(exec_dir / f"{job.id}.jsonl", {"event": "start", "job": job.id, "rank": 0, "t": 1001.0})
    worker_log = tmp_path / "supervisor.log"
    worker_log.write_text(f'{{"msg": "other"}}\n{{"msg": "took it", "job_id": "{job.id}"}}\n{{"msg": "last"}}\n')
    timeline = [{"t": 990.0, "event": "fault", "kind": "redis_restart"}, {"t": 5000.0, "event": "fault"}]
    out = keep_evidence(tmp_path / "evidence", redis_client, job.id, why=[f"{job.id} (normal): state 'rendering'"],
                        exec_log_dir=exec_dir, timeline=timeline, worker_log=worker_log,
                        redis_log=tmp_path / "absent.log", submitted_at=999.0)  # fmt: skip
    assert out == tmp_path / "evidence" / job.id
    assert "state 'rendering'" in _read(out, "why.txt")
    fields = _read(out, "hash.json")["fields"]
    assert fields["meta"]["state"] == "rendering" and fields["data"][0] == "worker.job.render"
    assert _read(out, "events.jsonl")[0]["data"]["state"] == "started"
    registries = _read(out, "registries.json")
    assert registries[f"rq:queue:{queue}"]["type"] == "list" and registries[f"rq:failed:{queue}"]["score"] == 12345
    assert _read(out, "exec_log.jsonl")[0]["event"] == "start"
    assert [e["near"] for e in _read(out, "timeline.jsonl")] == [True, False]
    assert _read(out, "worker_log_job.txt").strip() == f'{{"msg": "took it", "job_id": "{job.id}"}}'
    assert '"last"' in _read(out, "worker_log_tail.txt") and "no file at" in _read(out, "redis_log_tail.txt")
    # a job of which nothing is left: the folder still says so, and nothing raises
    gone = keep_evidence(tmp_path / "evidence", redis_client, "gone-job", why=["gone-job: job hash gone"],
                         exec_log_dir=exec_dir, timeline=[], worker_log=None, redis_log=None)  # fmt: skip
    assert _read(gone, "hash.json")["exists"] is False and _read(gone, "registries.json") == {}


def test_a_planted_loss_leaves_evidence_named_in_the_report(tmp_path: Any, s3_server: Any, redis_server: Any) -> None:
    """Negative control of the evidence: mid-run, one accepted job is taken out of its queue (a Redis that
    drops a queued job). The run must count it lost, keep its folder and name it on the report line."""
    del redis_server  # (only to fail early when redis-server is missing; the run starts its own with AOF)
    report, verdict = run_chaos(tmp_path, seed=25, jobs=6, faults=1, bad_inputs=0, s3=s3_server, settle_timeout=120,
                                fault_kinds=("raise",), plant="lost")  # fmt: skip
    summary = json.dumps(report.details, default=str)[:8000]
    planted = [line.split(" ")[0] for line in verdict.lost if "(planted_lost)" in line]
    assert len(planted) == 1 and report.lost >= 1 and not report.ok, summary
    evidence = report.details["evidence"]
    assert planted[0] in evidence["jobs"] and f"in {evidence['folder']}" in report.line(), report.line()
    folder = Path(evidence["folder"]) / planted[0]
    assert "state 'queued'" in _read(folder, "why.txt")
    assert _read(folder, "hash.json")["fields"]["status"] == "queued"
    assert not any(key.startswith("rq:queue:") for key in _read(folder, "registries.json"))  # taken out of it
    events = [e["event"] for e in _read(folder, "timeline.jsonl")]
    assert "planted_lost" in events and "fault" in events
    assert _read(folder, "worker_log_tail.txt").strip()
