"""Chaos suite: the real render stack (Redis with AOF, SeaweedFS, an `ltx-worker` supervisor with two CPU
groups, the smoke model) under a seeded schedule of jobs, injected faults and hostile requests, judged by an
invariant checker that reads Redis, the bucket and the runner's execution log.

`engine.run_chaos()` is shared by the bounded CI test (`test_chaos.py`) and the long soak
(`python -m tests.chaos.soak`).
"""
