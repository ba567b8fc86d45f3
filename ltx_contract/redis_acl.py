"""Redis ACL users for the render service: a generator of the `users.acl` file (`ltx-worker redis-acl`).

Without ACLs anyone who can reach Redis is an operator: `PUBLISH`es RQ's commands, edits or deletes any
job hash, `FLUSHALL`s (docs/security.md). The file this module writes gives Redis 7 these users:

| user          | may                                                                                  |
|---------------|--------------------------------------------------------------------------------------|
| `default`     | nothing (off, no password): every client must log in; it keeps all permissions only  |
|               | for the append-only file's replay at start (see `DEFAULT_USER_RULE`)                 |
| worker        | every command on `rq:*` and `ltx:*` keys and RQ's `rq:*` pubsub channels, except the  |
|               | `@dangerous` ones (FLUSHALL/FLUSHDB, CONFIG, SHUTDOWN, DEBUG, ACL, MODULE, REPLICAOF, |
|               | KEYS, MONITOR, ...); `INFO` and `CLIENT LIST` are allowed back (RQ reads the server   |
|               | version and its own address)                                                         |
| a tenant `t`  | read and write only its own jobs: job hashes `rq:job:t-*`, event streams             |
|               | `ltx:job:t-*`, its admission set `ltx:producer:client:t:jobs` (and read its RQ results |
|               | `rq:results:t-*`); read the shared structure `ls`/`stats` need (queue lists, RQ's     |
|               | registries and worker keys, workers' health snapshots: job ids and counts, no job     |
|               | content); append to its own queues only (`RPUSH`/`LPUSH` on `rq:queue:*:t:t`, an ACL  |
|               | selector): not the shared queue, not `rq:queues`; no `SELECT`, no pubsub, no admin    |
| a ping user   | (optional, for container health checks) `PING` only, no password                     |
| an admin user | (`--admin-user`, `admin` by default) what operators need without a restart: `ACL LOAD`|
|               | (after the file was written again), `ACL LOG`, `ACL LIST`/`USERS`/`GETUSER`/`WHOAMI`, |
|               | `INFO`, `CLIENT LIST`, `SLOWLOG GET`; no key, no channel, no other admin command      |

A tenant's job ids therefore start with `t-` (`LTX_TENANT_IDS`, implied for the producer by
`LTX_REDIS_USERNAME`), and tenant names are 1-32 letters, digits or `_` (`ltx_contract.keys.check_tenant_name`):
with no `-` in a name, `alice-*` never matches another tenant's keys. What each grant is for was read off
`MONITOR` while the producer submitted, cancelled and fetched, and is held by `tests/test_redis_acl.py`
(every command of the end-to-end run passes the ACL; each attack is refused).

Run as `ltx-worker redis-acl` or, where only the producer's files are installed (its image, compose's
`redis-acl` service), `python -m ltx_contract.redis_acl`; it imports click and `ltx_contract.keys` only.

Passwords never appear on the command line: each user's password is read from `<password-dir>/<user>`
(docker or k8s secrets) or from the environment variable `LTX_REDIS_ACL_PASSWORD_<USER>`; only their
sha256 reaches the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import click

from ltx_contract.keys import KEY_PREFIX, TENANT_QUEUE_INFIX, check_tenant_name

__all__ = [
    "ACL_PASSWORD_ENV_PREFIX",
    "DEFAULT_USER_RULE",
    "REDIS_MEMORY_ARGS",
    "AclUsers",
    "admin_rules",
    "command",
    "generate",
    "password_for",
    "render_acl",
    "tenant_rules",
    "worker_rules",
]

ACL_PASSWORD_ENV_PREFIX = "LTX_REDIS_ACL_PASSWORD_"

#: Memory limits every Redis of the service runs with, next to its users (docker-compose.yml and
#: docs/operations.md repeat them; tests/test_compose.py keeps the three in step; `devstack.dev_servers` starts
#: every development Redis with them). A client that asks for replies and does not read them (three
#: `HGETALL`s of a 90 MB hash on a raw socket held 476 MB against a 300 MB `maxmemory`, and every write
#: failed) is disconnected once its output buffer passes 32 MB, or 8 MB for 10 s; no single value (a hash
#: field, a string) can exceed 4 MB, four times the largest request the worker accepts.
REDIS_MEMORY_ARGS = ("--client-output-buffer-limit", "normal 32mb 8mb 10", "--proto-max-bulk-len", "4mb")
_USER = re.compile(r"[A-Za-z0-9_]{1,32}")

# `default` is off and has no password (and no `nopass`): no client can log in as it (AUTH and HELLO
# answer WRONGPASS, commands before AUTH NOAUTH). It still holds every permission because Redis and Valkey
# replay the append-only file as `default` and EXEC re-checks its ACL: with `-@all` every MULTI/EXEC that
# RQ wrote (each enqueue, each status change) is dropped on restart and queued jobs vanish (redis/redis#14541,
# valkey#3983). Held by tests/test_redis_restart.py on a real restart.
DEFAULT_USER_RULE = "user default off resetpass resetkeys resetchannels ~* &* +@all"


def admin_rules() -> str:
    """ACL rules of the admin user: reload and inspect the ACLs, read server state; no data, no other admin
    command (`ACL SETUSER` would let it grant itself anything: users change through the file)."""
    return (
        "resetkeys resetchannels -@all +@connection -client +client|list +client|id +client|setname "
        "+info +slowlog|get +acl|load +acl|log +acl|list +acl|users +acl|getuser +acl|whoami"
    )


def worker_rules() -> str:
    """ACL rules of the worker user (and of operators' tools: `producer` with `LTX_OPERATOR=true`)."""
    # INFO: RQ reads the server version; CLIENT LIST: RQ finds its own address at start (`rq info` shows it)
    return f"resetkeys resetchannels ~rq:* ~{KEY_PREFIX}:* &rq:* -@all +@all -@dangerous +info +client|list"


def tenant_rules(tenant: str) -> str:
    """ACL rules of tenant `tenant`'s producer user: see the module docstring."""
    t = check_tenant_name(tenant)
    own = f"~rq:job:{t}-* ~{KEY_PREFIX}:job:{t}-* ~{KEY_PREFIX}:producer:client:{t}:jobs"
    # Shared structure only: ids and counts, never another tenant's prompts, results, URLs or events.
    shared = (
        "rq:queue:*",
        "rq:queues",
        "rq:wip:*",
        "rq:finished:*",
        "rq:failed:*",
        "rq:canceled:*",
        "rq:deferred:*",
        "rq:scheduled:*",
        "rq:workers",
        "rq:workers:*",
        "rq:worker:*",
        f"{KEY_PREFIX}:worker:*:health",
    )
    reads = " ".join([f"%R~rq:results:{t}-*", *(f"%R~{pattern}" for pattern in shared)])
    # No SELECT: key patterns hold in every database, so databases 1-15 would give a tenant keyspaces that
    # no worker serves or cleans; clients stay in the database of their URL (0 in compose).
    commands = (
        "-@all +@read -@dangerous +@connection -select -client +client|setname +client|getname +client|id "
        "+multi +exec +discard +watch +unwatch +hset +hsetnx +hdel +expire +pexpire +persist +del +unlink "
        "+xadd +xtrim +zadd +zrem +zremrangebyscore"
    )
    # Selector: the tenant's own queues (`<queue>:t:<t>`, ltx_contract.keys.tenant_queue) may only be appended to;
    # never the shared queue, RQ's intermediate lists (`...:t:<t>:intermediate` does not match) or the set
    # of queues (workers register the queues they serve: a tenant could add names without bound).
    selectors = f"(+rpush +lpush %W~rq:queue:*{TENANT_QUEUE_INFIX}{t})"
    return f"resetkeys resetchannels {own} {reads} {commands} {selectors}"


@dataclass(frozen=True)
class AclUsers:
    """Who gets a Redis user: the worker's user name, the tenants (one producer user each), an optional
    password-less user that can only `PING` (container health checks), an optional admin user (`ACL LOAD`,
    `ACL LOG`: the CLI adds `admin` unless told otherwise)."""

    worker: str = "worker"
    tenants: tuple[str, ...] = ()
    ping_user: str | None = None
    admin: str | None = None

    def __post_init__(self) -> None:
        for tenant in self.tenants:
            check_tenant_name(tenant)
        names = [self.worker, *self.tenants, *([self.ping_user] if self.ping_user else [])]
        names += [self.admin] if self.admin else []
        for name in names:
            if not _USER.fullmatch(name) or name == "default":
                raise ValueError(f"user name {name[:40]!r}: use 1-32 letters, digits or _ (not 'default')")
        if len(set(names)) != len(names):
            raise ValueError(f"user names must differ: {names}")


def password_for(user: str, *, password_dir: Path | None, environ: Mapping[str, str] | None = None) -> str:
    """`user`'s password: the file `<password_dir>/<user>` if it exists, else `LTX_REDIS_ACL_PASSWORD_<USER>`;
    ValueError if neither (or an empty one)."""
    env = os.environ if environ is None else environ
    if password_dir is not None:
        path = Path(password_dir) / user
        if path.is_file():
            text = path.read_text().strip()
            if not text:
                raise ValueError(f"password file {path} for Redis user {user!r} is empty")
            return text
    value = env.get(ACL_PASSWORD_ENV_PREFIX + user.upper(), "").strip()
    if value:
        return value
    where = f"{Path(password_dir) / user} or " if password_dir is not None else ""
    raise ValueError(f"no password for Redis user {user!r}: put it in {where}{ACL_PASSWORD_ENV_PREFIX}{user.upper()}")


def render_acl(users: AclUsers, passwords: Mapping[str, str]) -> str:
    """The ACL file (`redis-server --aclfile`): one `user` line per user, passwords as sha256 only."""

    def secret(name: str) -> str:
        password = passwords[name]
        if len(password) < 16:
            raise ValueError(f"the password of Redis user {name!r} is shorter than 16 characters")
        return "#" + hashlib.sha256(password.encode()).hexdigest()

    lines = [DEFAULT_USER_RULE]
    lines.append(f"user {users.worker} on {secret(users.worker)} {worker_rules()}")
    lines.extend(f"user {t} on {secret(t)} {tenant_rules(t)}" for t in users.tenants)
    if users.ping_user:
        lines.append(f"user {users.ping_user} on nopass resetkeys resetchannels -@all +ping")
    if users.admin:
        lines.append(f"user {users.admin} on {secret(users.admin)} {admin_rules()}")
    return "\n".join(lines) + "\n"


def generate(users: AclUsers, *, password_dir: Path | None, environ: Mapping[str, str] | None = None) -> str:
    """Read every user's password (files, then environment) and render the ACL file."""
    names: Iterable[str] = [users.worker, *users.tenants, *([users.admin] if users.admin else [])]
    return render_acl(users, {name: password_for(name, password_dir=password_dir, environ=environ) for name in names})


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--worker-user", default="worker", show_default=True, help="the workers' (and operators') user")
@click.option("--tenant", "tenants", multiple=True, help="a producer user per tenant (1-32 letters, digits, _)")
@click.option("--ping-user", default=None, help="also a password-less user that can only PING (health checks)")
@click.option(
    "--admin-user", default="admin", show_default=True, help="the user for ACL LOAD / ACL LOG (operators); '' for none"
)
@click.option(
    "--password-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="directory with one password file per user, named after it (e.g. /run/secrets)",
)
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="write here (default: stdout)")
def command(
    worker_user: str,
    tenants: tuple[str, ...],
    ping_user: str | None,
    admin_user: str,
    password_dir: str | None,
    output: str | None,
) -> None:
    """Print a Redis ACL file (`redis-server --aclfile`) for the worker and one user per tenant.

    Passwords come from <password-dir>/<user> or LTX_REDIS_ACL_PASSWORD_<USER>, never from the command
    line; only their sha256 is written. See docs/operations.md ("Redis users, passwords and TLS")."""
    try:
        users = AclUsers(worker=worker_user, tenants=tuple(tenants), ping_user=ping_user, admin=admin_user or None)
        text = generate(users, password_dir=Path(password_dir) if password_dir else None)
    except ValueError as exc:
        click.echo(f"redis-acl: {exc}", err=True)
        sys.exit(2)
    if output is None:
        click.echo(text, nl=False)
        return
    tmp = Path(output).with_name(Path(output).name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)  # (sha256 digests only; redis-server runs as another user in its container)
    os.replace(tmp, output)
    names = [worker_user, *tenants, *([ping_user] if ping_user else []), *([admin_user] if admin_user else [])]
    click.echo(f"wrote {output}: users {', '.join(names)} (default: off)", err=True)


if __name__ == "__main__":
    command()
