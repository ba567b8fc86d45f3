"""How the worker and the producer connect to Redis: user, password (from a file), TLS. One place for both.

`LTX_REDIS_URL` stays the address (and may still carry `user:password@`: supported, masked everywhere).
The other `LTX_REDIS_*` settings add what a URL should not hold in a deployment:

| setting                    | what                                                                        |
|----------------------------|-----------------------------------------------------------------------------|
| `LTX_REDIS_USERNAME`       | the Redis 6+ ACL user (`worker`, or a tenant's name: `ltx-worker redis-acl`) |
| `LTX_REDIS_PASSWORD`       | its password (a `SecretStr`: masked in `settings` output, never logged)      |
| `LTX_REDIS_PASSWORD_FILE`  | read the password from this file (docker/k8s secrets); wins over the above  |
| `LTX_REDIS_CA_FILE`        | CA bundle that signed the server's certificate (`rediss://` URLs only)       |
| `LTX_REDIS_CERT_FILE`      | client certificate, when the server asks for one (`tls-auth-clients yes`)   |
| `LTX_REDIS_KEY_FILE`       | the client certificate's private key                                        |

redis-py lets URL parts win over keyword arguments, so a user or password given both in the URL and in
these settings is refused at start (one of them would be ignored silently). Every connection a process
opens is made by `connect()` (or copies the pool of one made by it: the worker's heartbeat connection, RQ's
pubsub), so none of them can miss the TLS or credential settings.

Imports only pydantic and (lazily) redis: the producer imports it without pulling in rq, torch or boto3.
"""

from __future__ import annotations

import ssl
import threading
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from ltx_contract.shared_settings import (
    check_queue_names,
    check_redis_url,
    read_secret_file,
    safe_redis_url,
    split_list,
)

__all__ = ["RedisAccess", "ServiceAccess", "connect", "connection_kwargs", "redis_problem", "single_try"]


class RedisAccess(BaseModel):
    """The `LTX_REDIS_*` fields besides the URL; mixed into `WorkerSettings` and `ProducerSettings`
    (their env prefix and `redis_url` field apply). The password file is read once, at validation."""

    redis_username: str | None = Field(None, description="Redis ACL user (unset: the URL's, or `default`)")
    redis_password: SecretStr | None = Field(None, description="Redis password (prefer redis_password_file)")
    redis_password_file: Path | None = Field(None, description="read the Redis password from this file")
    redis_ca_file: Path | None = Field(None, description="CA bundle for a rediss:// server's certificate")
    redis_cert_file: Path | None = Field(None, description="client certificate for rediss:// (mutual TLS)")
    redis_key_file: Path | None = Field(None, description="private key of redis_cert_file")

    @model_validator(mode="after")
    def _check_redis_access(self) -> RedisAccess:
        url: str = getattr(self, "redis_url", "")
        if self.redis_password_file is not None:
            text = read_secret_file(self.redis_password_file, "redis_password_file")
            if not text:
                raise ValueError(f"redis_password_file (LTX_REDIS_PASSWORD_FILE): {self.redis_password_file} is empty")
            object.__setattr__(self, "redis_password", SecretStr(text))
        user_in_url, password_in_url = _url_credentials(url)
        if self.redis_password is not None and password_in_url:
            raise ValueError(
                "the Redis password is set both in LTX_REDIS_URL and in LTX_REDIS_PASSWORD(_FILE): "
                "keep one (the URL's would win)"
            )
        if self.redis_username is not None and user_in_url:
            raise ValueError("the Redis user is set both in LTX_REDIS_URL and in LTX_REDIS_USERNAME: keep one")
        tls_files = {
            "LTX_REDIS_CA_FILE": self.redis_ca_file,
            "LTX_REDIS_CERT_FILE": self.redis_cert_file,
            "LTX_REDIS_KEY_FILE": self.redis_key_file,
        }
        given = [name for name, path in tls_files.items() if path is not None]
        if given and not url.startswith("rediss://"):
            raise ValueError(
                f"{', '.join(given)}: TLS files go with a rediss:// LTX_REDIS_URL, not {safe_redis_url(url)}"
            )
        if (self.redis_cert_file is None) != (self.redis_key_file is None):
            raise ValueError("LTX_REDIS_CERT_FILE and LTX_REDIS_KEY_FILE: set both or neither")
        for name, path in tls_files.items():
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        return self


class ServiceAccess(RedisAccess):
    """`RedisAccess` and the checks of `redis_url` and `queues`: the base of `WorkerSettings` and
    `ProducerSettings`, which read `LTX_REDIS_URL` and `LTX_QUEUES` alike. Each declares both fields itself
    (its own default and description); the checks apply to them there."""

    @field_validator("queues", mode="before", check_fields=False)
    @classmethod
    def _split_queues(cls, value: Any) -> Any:
        return split_list(value, ",")

    @field_validator("queues", check_fields=False)
    @classmethod
    def _check_queues(cls, value: list[str]) -> list[str]:
        return check_queue_names(value)

    @field_validator("redis_url", check_fields=False)
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        return check_redis_url(value)


def _url_credentials(url: str) -> tuple[bool, bool]:
    """(user given, password given) in a redis URL's authority part."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return False, False
    return bool(parts.username), parts.password is not None and parts.password != ""


def connection_kwargs(settings: Any) -> dict[str, Any]:
    """redis-py keyword arguments for `settings` (a `RedisAccess`): credentials and TLS, nothing else."""
    kwargs: dict[str, Any] = {}
    if settings.redis_username is not None:
        kwargs["username"] = settings.redis_username
    if settings.redis_password is not None:
        kwargs["password"] = settings.redis_password.get_secret_value()
    if str(settings.redis_url).startswith("rediss://"):
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED  # (redis-py's default too; stated, never weakened)
        if settings.redis_ca_file is not None:
            kwargs["ssl_ca_certs"] = str(settings.redis_ca_file)
        if settings.redis_cert_file is not None:
            kwargs["ssl_certfile"] = str(settings.redis_cert_file)
            kwargs["ssl_keyfile"] = str(settings.redis_key_file)
    return kwargs


def connect(settings: Any, **options: Any) -> Any:
    """A `redis.Redis` for `settings.redis_url` with the credentials and TLS of `settings`; `options` are
    the caller's timeouts and the like."""
    import redis

    return redis.Redis.from_url(settings.redis_url, **connection_kwargs(settings), **options)


_SINGLE_TRY: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_SINGLE_TRY_LOCK = threading.Lock()


def single_try(client: Any) -> Any:
    """A client of the same server, user and TLS as `client` whose commands are sent once.

    redis-py 8 sends a command again after a connection error, up to 10 times, by default. A write that
    Redis executed just before the connection dropped (a restart: Redis persists what it ran and may close
    the socket before the reply leaves) is then applied twice: an event, a result, a queue push. Writers
    whose repetition matters use this client and retry themselves, knowing what a retry may repeat
    (`ltx_contract.event_stream`). One per connection pool (its own pool, the same limits); a test double
    without a pool is returned as it is."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, redis.ConnectionPool):
        return client
    with _SINGLE_TRY_LOCK:
        found = _SINGLE_TRY.get(pool)
        if found is None:
            # (the maintenance-notification handler belongs to its pool: the new pool makes its own)
            kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "maint_notifications_pool_handler"}
            kwargs["retry"] = Retry(NoBackoff(), 0)
            found = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
                )
            )
            _SINGLE_TRY[pool] = found
        return found


def redis_problem(exc: BaseException, redis_url: str | None = None) -> tuple[str, bool] | None:
    """(one line saying what is wrong, whether the settings are) if `exc` says Redis cannot be used at all:
    unreachable, too slow, refused credentials (WRONGPASS, NOAUTH) or command (NOPERM), no such database,
    not speaking the Redis protocol, or a failed TLS handshake. None for errors about the data, which
    belong to the job or the command. The one wording of these for the producer and the worker (the worker
    exits 2 with it where the settings are wrong: `worker.runtime.process.wait_for_redis`)."""
    import redis

    where = f" at {safe_redis_url(redis_url)}" if redis_url else ""
    text = " ".join(str(exc).split())[:300]  # (one line, whatever the server sent)
    if isinstance(exc, redis.AuthenticationError):
        if "required" in text.lower() or "already authenticated" in text.lower():  # (RESP3's HELLO says so)
            return (
                f"Redis{where} requires authentication (NOAUTH): set LTX_REDIS_USERNAME and "
                "LTX_REDIS_PASSWORD_FILE (or the password in the URL)",
                True,
            )
        return (
            f"Redis authentication failed{where} (WRONGPASS: {text}): check LTX_REDIS_USERNAME and "
            "LTX_REDIS_PASSWORD(_FILE)",
            True,
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis{where} refused a command to this user (NOPERM: {text}): the ACL (`ltx-worker "
            "redis-acl`) does not allow it",
            True,
        )
    if isinstance(exc, redis.ResponseError) and "db index" in text.lower():
        db = urlsplit(redis_url).path.strip("/") if redis_url else "?"
        return f"Redis{where} has no database {db} ({text}): fix the /N at the end of LTX_REDIS_URL", True
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return (
            f"the server{where} does not speak the Redis protocol ({text}): does LTX_REDIS_URL name "
            "another service's port?",
            True,
        )
    if isinstance(exc, redis.TimeoutError):
        return f"Redis{where} did not answer in time ({text})", False
    if isinstance(exc, redis.ConnectionError):
        if "ssl" in text.lower() or "certificate" in text.lower() or "tls" in text.lower():
            return (
                f"TLS with Redis{where} failed ({text}): check LTX_REDIS_CA_FILE / LTX_REDIS_CERT_FILE "
                "and the rediss:// URL",
                True,
            )
        return f"cannot reach Redis{where}: {text}", False
    return None
