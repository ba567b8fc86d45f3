"""Checks of the `LTX_*` settings the worker and the producer both read (same variables, same meaning):
queue names, the Redis URL, secret files. Standard library only (the producer shares it)."""

from __future__ import annotations

import json
import re
from typing import Any

from ltx_contract.keys import TENANT_QUEUE_INFIX

__all__ = [
    "S3_SECRET_FILE_FIELDS",
    "check_queue_names",
    "check_redis_url",
    "read_secret_file",
    "safe_redis_url",
    "split_list",
]

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def split_list(value: Any, sep: str) -> Any:
    """An environment value as a list: a JSON array, or items separated by `sep`; other values pass."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(sep) if part.strip()]
    return value


def check_queue_names(names: list[str]) -> list[str]:
    """Queue names become Redis key parts: at least one, and only letters, digits and `_.:-`."""
    if not names:
        raise ValueError("at least one queue is needed")
    for name in names:
        if not _QUEUE_NAME.fullmatch(name):
            raise ValueError(f"queue name {name!r} may only contain letters, digits and _.:-")
        if TENANT_QUEUE_INFIX in name:
            raise ValueError(f"queue name {name!r}: {TENANT_QUEUE_INFIX!r} is reserved for tenant queues")
    return names


def safe_redis_url(url: str) -> str:
    """The Redis URL without its password, for messages and logs."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


#: (secret field, field naming a file that holds it): the S3 key pairs both settings classes read from files
#: (`LTX_S3_ACCESS_KEY_ID_FILE`, ...: compose secrets); a file wins over the plain variable.
S3_SECRET_FILE_FIELDS = (
    ("s3_access_key_id", "s3_access_key_id_file"),
    ("s3_secret_access_key", "s3_secret_access_key_file"),
)


def read_secret_file(path: Any, file_field: str) -> str:
    """The stripped contents of a secret file; ValueError naming the setting (never the contents)."""
    from pathlib import Path

    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{file_field} (LTX_{file_field.upper()}): cannot read {path}: {exc.strerror}") from None


def check_redis_url(url: str) -> str:
    """The one check of a Redis URL, for the worker and the producer alike (`ServiceAccess`). Besides the
    scheme it refuses what redis-py would silently read as something else: a database path that is not a
    number (`/abc` and `/0/1` become DB 0 and DB 1 there) and a port that is not one."""
    from urllib.parse import parse_qs, urlsplit

    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must start with redis://, rediss:// or unix://")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError as exc:
        raise ValueError(f"{safe_redis_url(url)}: {exc}") from None
    db = parse_qs(parts.query).get("db")
    if db is not None and not (len(db) == 1 and db[0].isdigit()):
        raise ValueError(f"{safe_redis_url(url)}: ?db= must be one database number")
    if not url.startswith("unix://") and db is None and parts.path not in ("", "/"):
        number = parts.path[1:]
        if not (number.isdigit() and number.isascii()):
            raise ValueError(
                f"{safe_redis_url(url)}: the path must be a database number (/0, /1, ...), not {parts.path!r}"
            )
    return url
