"""One chaos run: a seeded schedule of jobs, faults and hostile requests against a `ChaosStack`, then the
invariant checker and a report.

Faults (each counted once; "survived" = its target job ended as planned, or for service-wide faults, every
job in flight across it did, and the service still rendered the final canary jobs):

| kind               | how                                                                                |
|--------------------|------------------------------------------------------------------------------------|
| kill_rank          | runner: the last rank SIGKILLs itself mid-denoise (expect uploaded after a retry)  |
| hang               | runner: the last rank hangs past the render timeout (expect uploaded after retry)  |
| raise              | runner: RunnerError on the last rank only (expect failed, fleet survives)          |
| kill_worker_render | SIGKILL of the worker process running a job, mid-render (expect uploaded)          |
| kill_worker_upload | S3 blocked, SIGKILL of the worker while the job uploads, S3 back (expect uploaded) |
| redis_restart      | Redis restarted (SIGTERM, or SIGKILL in the soak) with jobs queued and running     |
| s3_outage          | S3 unreachable for a few seconds while jobs upload                                 |

Hostile requests (see hostile.py) go first, while nothing else is in flight, so "no worker died and no
fleet was rebuilt" can be checked exactly.

Every job the checker flags gets an evidence folder (evidence.py) before the stack is torn down; the
report's line names it. `plant="lost"` is the evidence's negative control: one accepted job is taken out
of its queue before a worker takes it, so the run must report it lost and keep its evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltx_contract.keys import tenant_queue
from ltx_contract.schema import RenderRequest
from producer.client import ProducerClient
from producer.settings import ProducerSettings
from tests.chaos import hostile
from tests.chaos.evidence import keep_evidence
from tests.chaos.hostile import HOSTILE, VICTIM, BadInput
from tests.chaos.invariants import TERMINAL, Accepted, Verdict, check, job_state
from tests.chaos.stack import ChaosStack
from tests.chaos.watchdog import Stalled, Watchdog
from tests.support.wait import wait_for

__all__ = ["FAULT_KINDS", "Report", "run_chaos"]

FAULT_KINDS = ("kill_rank", "hang", "raise", "kill_worker_render", "kill_worker_upload", "redis_restart",
               "s3_outage")  # fmt: skip
TINY = {"width": 64, "height": 64, "num_frames": 9}


@dataclass
class Report:
    seed: int
    faults: int = 0
    survived: int = 0
    jobs: int = 0
    unexpected: int = 0  #: jobs that ended, but not as their fault (or none) predicts
    lost: int = 0
    duplicated: int = 0
    corrupt: int = 0
    leaked: int = 0
    bad_inputs: int = 0
    rejected: int = 0
    stalled: int = 0  #: steps that passed their deadline (the seed fails naming what it waited for)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        evidence = self.details.get("evidence")
        return (
            f"faults {self.faults}, survived {self.survived}, jobs {self.jobs}, unexpected {self.unexpected}, "
            f"lost {self.lost}, duplicated {self.duplicated}, corrupt {self.corrupt}, leaked processes {self.leaked}, "
            f"bad inputs {self.bad_inputs} rejected {self.rejected}, stalled {self.stalled}"
            + (f"; evidence of {len(evidence['jobs'])} jobs in {evidence['folder']}" if evidence else "")
        )

    @property
    def ok(self) -> bool:
        return (self.unexpected == self.lost == self.duplicated == self.corrupt == self.leaked == self.stalled == 0
                and self.survived == self.faults and self.rejected == self.bad_inputs and self.jobs > 0
                and not self.details.get("memory") and not self.details.get("error"))  # fmt: skip

    def add(self, other: Report) -> None:
        """Sum `other`'s counts into this one (the soak's total line)."""
        for name in ("faults", "survived", "jobs", "unexpected", "lost", "duplicated", "corrupt", "leaked",
                     "bad_inputs", "rejected", "stalled", "seconds"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))


class _NotInjected(Exception):
    pass


class _Run:
    def __init__(self, stack: ChaosStack, rng: random.Random, log: Callable[[dict[str, Any]], None],
                 hard_redis: bool) -> None:  # fmt: skip
        self.stack = stack
        self.rng = rng
        self.log = log
        self.hard_redis = hard_redis
        self.accepted: list[Accepted] = []
        self.fault_jobs: list[tuple[str, list[str]]] = []  # (kind, job ids that must end as planned)
        self.not_injected: list[str] = []  # kinds of faults whose target never reached the state to hit
        self.planted: list[str] = []  # jobs `plant_lost` took out of the queue (not waited for; must be flagged)
        self.timeline: list[dict[str, Any]] = []  # every logged event with its wall-clock time (the evidence's)
        self.evidence: dict[str, Path] = {}  # job id -> its evidence folder
        self.submitted_at: dict[str, float] = {}  # job id -> wall-clock time of its submit
        settings = ProducerSettings(redis_url=stack.redis.url, queues=[stack.queue], max_queue_depth=0,
                                    job_timeout=120, result_ttl=3600, failure_ttl=3600, client=VICTIM,
                                    tenant_ids=True)  # fmt: skip
        self.queues = {"shared": stack.queue, **{t: tenant_queue(stack.queue, t) for t in (HOSTILE, VICTIM)}}
        self.client = ProducerClient(settings)
        self.n = 0

    def note(self, event: dict[str, Any]) -> None:
        """Log `event` and keep it, stamped, for the evidence of any job flagged later."""
        event = {"t": round(time.time(), 3), **event}
        self.timeline.append(event)
        self.log(event)

    def keep(self, why: dict[str, list[str]]) -> None:
        """Evidence for each flagged job (job id -> the checker's lines), while Redis and the logs are there."""
        st = self.stack
        for job_id, lines in why.items():
            self.evidence[job_id] = keep_evidence(
                st.workdir / "evidence", st.conn, job_id, why=lines, exec_log_dir=st.exec_log_dir,
                timeline=self.timeline, submitted_at=self.submitted_at.get(job_id),
                worker_log=st.workdir / "supervisor.log", redis_log=st.redis.log_path)  # fmt: skip

    def plant_lost(self) -> None:
        """The evidence's negative control: an accepted job removed from its queue before any worker took
        it (what a Redis that drops a queued job does). A worker that took it first renders it normally."""
        for _ in range(20):
            job_id = self.submit("planted_lost")
            if self.stack.conn.lrem(f"rq:queue:{self.queues[VICTIM]}", 0, job_id):
                self.planted.append(job_id)
                self.note({"event": "planted_lost", "job": job_id})
                return
        raise RuntimeError("could not plant a lost job: a worker took each one at once")

    # ---- submitting ------------------------------------------------------------------------------------
    def submit(self, kind: str = "normal", directives: str = "", *, steps: int = 1, expected: str = "uploaded",
               reasons: tuple[str, ...] = (), priority: str = "normal") -> str:  # fmt: skip
        self.n += 1
        prompt = f"chaos job {self.n} {directives}".strip()
        request = RenderRequest(prompt=prompt, seed=self.rng.randrange(2**31), steps=steps, **TINY)
        job = _retry(lambda: self.client.submit(request, priority=priority))
        self.accepted.append(Accepted(job.id, kind, expected, reasons))
        self.submitted_at[job.id] = time.time()
        return job.id

    def normal(self, count: int) -> list[str]:
        return [self.submit() for _ in range(count)]

    # ---- faults ----------------------------------------------------------------------------------------
    def fault(self, kind: str) -> None:
        t0 = time.monotonic()
        self.note({"event": "fault_start", "kind": kind})
        targets: list[str] = []
        not_injected = False
        if kind == "kill_rank":
            targets = [self.submit(kind, f"fault=kill_rank at={self.rng.randint(1, 2)}", steps=2)]
        elif kind == "hang":
            targets = [self.submit(kind, "fault=hang at=1", steps=2)]
        elif kind == "raise":
            targets = [self.submit(kind, "fault=raise at=1", steps=2, expected="failed",
                                   reasons=("asymmetric_runner_error", "runner_error"))]  # fmt: skip
        elif kind == "kill_worker_render":
            # (at the front of the queue: it starts as soon as a worker is free, not behind the backlog)
            jid = self.submit(kind, "hold_s=0.5", steps=8, priority="high")
            targets = [jid]
            not_injected = self._try_kill(jid, {"rendering"}, timeout=60)
        elif kind == "kill_worker_upload":
            self.stack.proxy.block()
            try:
                jid = self.submit(kind, priority="high")
                targets = [jid]
                not_injected = self._try_kill(jid, {"uploading", "rendered"}, timeout=20)
                time.sleep(1.0)
            finally:
                self.stack.proxy.unblock()
        elif kind == "redis_restart":
            targets = self.normal(3)
            time.sleep(self.rng.uniform(0.0, 1.0))
            waiting = [j for j in targets if job_state(self.stack.conn, j) not in TERMINAL]
            if self.hard_redis and self.rng.random() < 0.5:
                self.stack.redis.kill()
                self.stack.redis.start()
                how = "SIGKILL"
            else:
                self.stack.redis.restart()
                how = "SIGTERM"
            self.stack.renice(self.stack.redis.proc.pid if self.stack.redis.proc is not None else None)
            missing = [j for j in waiting if not self.stack.conn.exists(f"rq:job:{j}")]
            self.note({"event": "redis_restart", "how": how, "in_flight": len(waiting), "missing_after": missing})
            self.keep({j: [f"{j}: job hash gone after a Redis restart ({how})"] for j in missing})
            assert not missing, f"jobs lost by a Redis restart (AOF): {missing}"
        elif kind == "s3_outage":
            self.stack.proxy.block()
            try:
                targets = self.normal(2)
                time.sleep(self.rng.uniform(2.0, 4.0))
            finally:
                self.stack.proxy.unblock()
        else:
            raise ValueError(kind)
        if not_injected:
            self.not_injected.append(kind)
            return
        self.fault_jobs.append((kind, targets))
        self.note({"event": "fault", "kind": kind, "jobs": targets, "s": round(time.monotonic() - t0, 2)})

    def _try_kill(self, job_id: str, states: set[str], *, timeout: float) -> bool:
        """True if the fault could not be injected."""
        try:
            self._kill_worker_of(job_id, states, timeout)
        except _NotInjected:
            return True
        return False

    def _kill_worker_of(self, job_id: str, states: set[str], timeout: float) -> None:
        """SIGKILL the worker running `job_id` once it is in one of `states` (bounded: S3 may be blocked
        meanwhile, and a worker restarted during an S3 outage exits 2, see the report)."""
        conn = self.stack.conn
        try:
            wait_for(lambda: job_state(conn, job_id) in states, timeout, f"{job_id} in {states}", poll=0.02)
        except AssertionError:
            # e.g. the workers hold back (upload back-pressure) or are restarting: the job stays accepted
            # and checked, but this fault was not injected and is not counted
            self.note({"event": "fault_not_injected", "job": job_id, "state": job_state(conn, job_id)})
            raise _NotInjected() from None
        meta = json.loads(conn.hget(f"rq:job:{job_id}", "meta"))
        victim = next(h for h in self.stack.live_workers() if h["worker"] == meta["worker"])
        self.stack.pids_seen.setdefault(int(victim["pid"]), "worker")
        os.kill(int(victim["pid"]), signal.SIGKILL)
        self.note({"event": "sigkill_worker", "pid": victim["pid"], "job": job_id, "state": job_state(conn, job_id)})

    # ---- hostile input ---------------------------------------------------------------------------------
    def hostile(self, count: int, rng_seed: int) -> list[BadInput]:
        return hostile.run_hostile(self, count, rng_seed)


def _retry(fn: Callable[[], Any], deadline_s: float = 60.0) -> Any:
    """Submits ride out a Redis restart (the producer raises ServiceUnavailable meanwhile), for a while."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_chaos(workdir: Path, *, seed: int, jobs: int, faults: int, bad_inputs: int, s3: Any = None,
              hard_redis: bool = False, settle_timeout: float = 240.0, fault_kinds: Sequence[str] = FAULT_KINDS,
              worker_settings: dict[str, Any] | None = None, plant: str | None = None, nice: int = 0,
              render_timeout: float = 12.0,
              log: Callable[[dict[str, Any]], None] = lambda _: None) -> tuple[Report, Verdict]:  # fmt: skip
    """Run one seeded chaos schedule; return the report and the checker's verdict (never raises on a
    violated invariant or a stalled step: the report says so and is not ok; the caller decides).

    `fault_kinds`: the kinds to cycle through; `worker_settings`: overrides of the stack's worker settings
    (the negative control plants a defect this way, e.g. `{"retry_fleet_failure": 0}`); `plant="lost"`: one
    job taken out of its queue (the evidence's negative control); `nice`: the niceness of every process the
    stack starts, so CPU burners beside it starve it; `render_timeout`: the fleet's (raise it under heavy
    load: a starved 64x64 render outlasts 12 s, and fault-free jobs then fail like `hang`s)."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    if plant not in (None, "lost"):
        raise ValueError(f"plant: {plant!r}")
    stack = ChaosStack(Path(workdir) / f"seed{seed}", s3=s3, overrides=worker_settings, nice=nice,
                       render_timeout=render_timeout)  # fmt: skip
    report = Report(seed)
    verdict = Verdict()
    dog = Watchdog()
    try:
        with dog:
            verdict = _run_steps(dog, stack, rng, report, seed=seed, jobs=jobs, faults=faults, bad_inputs=bad_inputs,
                                 hard_redis=hard_redis, settle_timeout=settle_timeout, fault_kinds=fault_kinds,
                                 plant=plant, log=log)  # fmt: skip
    except Stalled as exc:
        report.stalled += 1
        report.details["stalled"] = {"what": exc.what, "seconds": exc.seconds, "stacks": exc.stacks}
        log({"event": "stalled", "what": exc.what, "seconds": exc.seconds})
    except Exception as exc:  # the run itself broke (e.g. a server did not start): a failed seed, with the cause
        report.details["error"] = f"{type(exc).__name__}: {exc}"
        log({"event": "error", "error": report.details["error"]})
    finally:
        report.seconds = round(time.monotonic() - t0, 1)
        if not report.ok:
            report.details["log_tail"] = stack.log_tail(4000)
        stack.cleanup()  # bounded by its own stop timeouts
    return report, verdict


def _run_steps(dog: Watchdog, stack: ChaosStack, rng: random.Random, report: Report, *, seed: int, jobs: int,
               faults: int, bad_inputs: int, hard_redis: bool, settle_timeout: float, fault_kinds: Sequence[str],
               plant: str | None, log: Callable[[dict[str, Any]], None]) -> Verdict:  # fmt: skip
    """The run, one deadline per step (see watchdog.py)."""
    with dog.step("stack start: Redis, S3 proxy, supervisor, both fleets ready", 300):
        stack.start()
    conn = stack.conn
    baseline_memory, baseline_keys = int(conn.info("memory")["used_memory"]), int(conn.dbsize())
    run = _Run(stack, rng, log, hard_redis)
    with dog.step("hostile input through the CLI, RQ and raw job hashes, then a probe job", 420):
        inputs = run.hostile(bad_inputs, seed)
    report.bad_inputs = len(inputs)
    report.rejected = sum(bool(b.rejected) for b in inputs)
    kinds = [fault_kinds[i % len(fault_kinds)] for i in range(faults)]
    rng.shuffle(kinds)
    fault_jobs = sum({"redis_restart": 3, "s3_outage": 2}.get(k, 1) for k in kinds)  # jobs each fault submits
    normal_total = max(0, jobs - fault_jobs - 3)  # 3 = hostile probe + 2 final canaries
    for i, kind in enumerate(kinds):
        share = normal_total // max(1, faults) + (1 if i < normal_total % max(1, faults) else 0)
        with dog.step(f"submitting {share} normal jobs before fault {i + 1}", 120):
            run.normal(share)
        with dog.step(f"fault {i + 1}/{len(kinds)}: {kind}", 180):
            run.fault(kind)
        if plant == "lost" and i == len(kinds) // 2:
            with dog.step("planting a lost job", 60):
                run.plant_lost()
        time.sleep(rng.uniform(0.0, 0.5))
    pending = [a.job_id for a in run.accepted if a.job_id not in run.planted]

    def unsettled() -> list[str]:
        return [f"{j}: {job_state(conn, j)}" for j in pending if job_state(conn, j) not in TERMINAL]

    with dog.step(f"every job terminal ({len(pending)} jobs)", settle_timeout + 60):
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not unsettled(), settle_timeout, "every job terminal", poll=0.2)
    if left := unsettled():
        report.details["unsettled_after_s"] = {"seconds": settle_timeout, "jobs": left[:20]}
        run.note({"event": "unsettled", "jobs": left[:20]})
    with dog.step("two canary jobs after the faults", 180):
        canaries = run.normal(2)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: all(job_state(conn, j) in TERMINAL for j in canaries), 120, "canaries", poll=0.1)
    with dog.step("warm stop of the supervisor and its workers", 150):
        rc = stack.stop()
    run.note({"event": "stopped", "rc": rc})
    with dog.step("leaked-process check", 60):
        report.leaked = len(leaked := stack.leaked(grace=20))
        stack.kill_leftovers(leaked)
    with dog.step("invariant check (Redis, bucket, execution log)", 300):
        verdict = check(conn, stack.s3.client(), stack.exec_log_dir, run.accepted,
                        baseline_memory=baseline_memory, baseline_keys=baseline_keys)  # fmt: skip
    verdict.leaked = leaked
    why: dict[str, list[str]] = {}
    for line in verdict.lost + verdict.duplicated + verdict.corrupt + verdict.unexpected:
        why.setdefault(line.split(" ")[0].rstrip(":"), []).append(line)
    with dog.step(f"keeping the evidence of {len(why)} flagged jobs", 120):
        run.keep(why)
    if run.evidence:
        report.details["evidence"] = {"folder": str(stack.workdir / "evidence"), "jobs": sorted(run.evidence)}
    run.client.close()
    canaries_ok = all(verdict.outcomes.get(c) == "uploaded" for c in canaries)
    bad_ids = set(why)
    report.faults = len(run.fault_jobs)
    report.survived = sum(canaries_ok and not any(t in bad_ids for t in targets) for _, targets in run.fault_jobs)
    report.jobs = len(run.accepted)
    report.unexpected = len(verdict.unexpected)
    report.lost, report.duplicated, report.corrupt = len(verdict.lost), len(verdict.duplicated), len(verdict.corrupt)
    report.details.update(lost=verdict.lost, duplicated=verdict.duplicated, corrupt=verdict.corrupt,
                          unexpected=verdict.unexpected, memory=verdict.memory, leaked=leaked, supervisor_rc=rc,
                          stats=verdict.stats, canaries_ok=canaries_ok, not_injected=run.not_injected,
                          injected=sorted({kind for kind, _ in run.fault_jobs}),
                          not_rejected=[(b.door, b.label, b.detail) for b in inputs if not b.rejected])  # fmt: skip
    return verdict
