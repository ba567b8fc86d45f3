"""docs/operations.md's "Redis users, passwords and TLS" recipes, run as written with bash: the users file,
the tenants' capped ports (HAProxy) and a tenant's submit through hers, adding a tenant with `ACL LOAD` as
the admin user, and the TLS certificates with Redis restarted on TLS only. Only what cannot be used here is
moved: `/etc/ltx` and `/var/lib/ltx-redis` into a test folder, the documented ports (Redis's 6379, the
tenants' 7001 and 7002) to free ones, the tenants' listen address to loopback, and `redis-server` /
`redis-cli` / `haproxy` are shell functions that run the real ones on those ports, the servers in the
background (stopped by pid).

Regressions: the recipe wrote Redis's AOF into the secrets folder (it `cd`ed there), a `--dir` folder
that did not exist stopped Redis, and the TLS paragraph had no way to make its certificates.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from devstack.dev_servers import pid_alive
from devstack.ports import free_ports
from tests.support.docstack import shell_blocks
from tests.support.wait import wait_for
from tests.support.workers import ROOT
from tests.test_docs_sync import DOCS, section

_SERVER = """
set -euo pipefail
redis-server() {
    local where=(--port "$PORT")
    case " $* " in *" --tls-port "*) where=(--tls-port "$PORT");; esac
    command redis-server "$@" "${where[@]}" --bind 127.0.0.1 >> "$WORK/redis.log" 2>&1 &
    echo $! > "$WORK/redis.pid"
    for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && return; sleep 0.05; done
    echo "redis-server did not start: $(tail -5 "$WORK/redis.log")" >&2; return 1
}
redis-cli() { command redis-cli -p "$PORT" "$@"; }
haproxy() {
    command "$HAPROXY" "$@" >> "$WORK/haproxy.log" 2>&1 &
    echo $! > "$WORK/haproxy.pid"
    for port in $TENANT_PORTS; do
        for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
    done
}
"""
_DOC_PORTS = {"6379": "PORT", "7001": "ALICE_PORT", "7002": "BOB_PORT"}  #: the page's ports -> variables here


def recipes() -> list[str]:
    text = section((DOCS / "operations.md").read_text(), "Redis users, passwords and TLS")
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def run(recipe: str, work: Path, port: int, tenant_ports: tuple[int, int] = (0, 0)) -> str:
    from devstack.haproxy import find_haproxy

    script = recipe.replace("/etc/ltx", str(work / "etc")).replace("/var/lib/ltx-redis", str(work / "data"))
    script = re.sub(r"\b(6379|7001|7002)\b", lambda m: "${" + _DOC_PORTS[m.group(1)] + "}", script)
    script = script.replace("--listen 0.0.0.0", "--listen 127.0.0.1")  # (a shared machine)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LTX_", "REDISCLI"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        PYTHONPATH=str(ROOT),
        WORK=str(work),
        PORT=str(port),
        HAPROXY=find_haproxy() or "haproxy",
        ALICE_PORT=str(tenant_ports[0]),
        BOB_PORT=str(tenant_ports[1]),
        TENANT_PORTS=" ".join(map(str, tenant_ports)),
        LTX_REDIS_URL=f"redis://127.0.0.1:{port}/0",
    )  # (the recipe's Redis is the local default)
    out = subprocess.run(["bash", "-c", _SERVER + script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, f"{script}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
    return out.stdout


def stop(work: Path, name: str = "redis") -> None:
    pid = int((work / f"{name}.pid").read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not pid_alive(pid), 20, f"{name} {pid} gone")
        return
    os.kill(pid, signal.SIGKILL)


def user(work: Path, port: int, name: str, **kwargs: Any) -> Any:
    password = (work / "etc" / "redis-secrets" / name).read_text().strip()
    return redis.Redis(host="127.0.0.1", port=port, username=name, password=password, socket_timeout=5, **kwargs)


def test_the_acl_reload_and_tls_recipes_run_as_written(tmp_path: Path, haproxy_binary: str) -> None:
    from devstack.dev_servers import find_redis_server

    if find_redis_server() is None or Path(find_redis_server() or "").name != "redis-server":
        pytest.skip("redis-server and redis-cli not found (apt-get install -y redis-server)")
    acl, reload, tls = recipes()
    port, *tenant_ports = free_ports(3)
    try:
        run(acl, tmp_path, port, (tenant_ports[0], tenant_ports[1]))
        secrets = tmp_path / "etc" / "redis-secrets"
        assert sorted(p.name for p in secrets.iterdir()) == ["admin", "alice", "bob", "worker"]  # no AOF here
        assert any((tmp_path / "data").glob("appendonlydir/*.aof"))
        worker = user(tmp_path, port, "worker")
        # (alice submits through her port on the proxy, to her own queue: ltx_contract.keys.tenant_queue)
        (job_id,) = [j.decode() for j in worker.lrange("rq:queue:ltx-render:t:alice", 0, -1)]
        assert job_id.startswith("alice-") and worker.hget(f"rq:job:{job_id}", "status") == b"queued"
        config = (tmp_path / "etc" / "redis-proxy.cfg").read_text()
        for tenant, tenant_port in zip(("alice", "bob"), tenant_ports, strict=True):
            assert f"frontend tenant_{tenant}\n    bind 127.0.0.1:{tenant_port}\n    maxconn 64\n" in config, config
        assert f"server redis 127.0.0.1:{port} " in config and pid_alive(int((tmp_path / "haproxy.pid").read_text()))

        run(reload, tmp_path, port)  # a new tenant, no restart
        assert user(tmp_path, port, "carol").hset("rq:job:carol-1", "status", "queued") == 1

        stop(tmp_path)
        run(tls, tmp_path, port)  # the same data, TLS only: the job survived the restart
        ca = tmp_path / "etc" / "redis-tls" / "ca.crt"
        alice = user(tmp_path, port, "alice", ssl=True, ssl_ca_certs=str(ca))
        assert alice.hget(f"rq:job:{job_id}", "status") == b"queued"
        with pytest.raises(redis.exceptions.ConnectionError):
            user(tmp_path, port, "alice").ping()  # no plain-text port
        assert oct((tmp_path / "etc" / "redis-tls" / "ca.key").stat().st_mode & 0o777) == "0o600"
    finally:
        for name in ("haproxy", "redis"):
            if (tmp_path / f"{name}.pid").exists():
                stop(tmp_path, name)


def test_every_documented_redis_dir_is_made_first() -> None:
    """`redis-server --dir D` stops at once when D does not exist: the page makes it in a recipe before."""
    for page in ("operations.md", "worker.md", "producer.md", "security.md"):
        text = (DOCS / page).read_text()
        blocks = [(m.start(), m.group(1)) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]
        for start, block in blocks:
            for match in re.finditer(r"redis-server\b[^\n]*?--dir (\S+)", block.replace("\\\n", " ")):
                before = "".join(b for s, b in blocks if s < start) + block.replace("\\\n", " ")[: match.start()]
                assert f"mkdir -p {match.group(1)}" in before, f"docs/{page}: --dir {match.group(1)} is never made"


# ==== what every shell block of README.md and docs/*.md names ============================================
# (which block runs where: tests/support/docstack.py; tests/test_docs_sync.py checks the lists)

_REPO_PATH = r"(?<![\w/.$-])((?:examples|scripts|bench|\.?/?kernels)/[\w./-]+|[\w-]+\.jsonl?)\b"


def test_every_file_a_shell_block_names_exists() -> None:
    """Regression: README's and producer.md's `producer backfill prompts.jsonl` named a file that is at
    examples/prompts.jsonl. Every repository file a block reads (examples/, scripts/, bench/) must exist."""
    missing = []
    for block in shell_blocks():
        page = block.page
        for word in re.findall(_REPO_PATH, block.script):
            if word.endswith(".manifest.jsonl") or word == "sp_scaling.jsonl":
                continue  # (files the command writes)
            if not (ROOT / word).exists() and not any(ROOT.glob(word)):
                missing.append(f"{page}: {word}")
    assert not missing, missing


def bench_modules_named(text: str) -> list[str]:
    """The modules `python -m bench.X` runs in `text` (a page, a script)."""
    return re.findall(r"python3? -m (bench(?:\.\w+)+)", text)


def test_every_bench_module_the_docs_run_exists() -> None:
    """Benchmarks run as `python -m bench.X` (bench/ is a package): each one a page or a session script names
    is a module of the tree (bench/X.py or the package bench/X/), in prose as in shell blocks."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "scripts").glob("*.sh"))]
    named = {(str(p.relative_to(ROOT)), m) for p in pages for m in bench_modules_named(p.read_text())}
    assert len(named) > 10  # (the check reads something)
    missing = []
    for page, module in sorted(named):
        path = ROOT / module.replace(".", "/")
        if not path.with_suffix(".py").is_file() and not (path / "__main__.py").is_file():
            missing.append(f"{page}: {module}")
    assert not missing, missing
    assert bench_modules_named("`python -m bench.e2e runs`, python3 -m bench.fp8_x") == ["bench.e2e", "bench.fp8_x"]


def test_the_settings_line_of_security_md_runs_as_written(tmp_path: Path) -> None:
    """The first command of security.md's checklist block needs no live service: run it, as written."""
    (block,) = [b for b in shell_blocks() if b.first.startswith("# the limits a worker enforces")]
    line = next(x for x in block.script.splitlines() if x.startswith("ltx-worker settings"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT))
    out = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"max_queue_depth"' in out.stdout and '"redis_url"' in out.stdout
