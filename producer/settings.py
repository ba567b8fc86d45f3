"""Producer settings: the same `LTX_*` environment variables as the worker where they mean the same thing.

One `.env` (or compose `environment:` block) configures both sides: `LTX_REDIS_URL`, `LTX_QUEUES` (the
first queue is where `submit` puts jobs), `LTX_RESULT_TTL`/`LTX_FAILURE_TTL`, and the `LTX_S3_*` storage
variables (used by `fetch` when credentials are present, plain or through `LTX_S3_ACCESS_KEY_ID_FILE` /
`LTX_S3_SECRET_ACCESS_KEY_FILE`: in compose the producer's key can only read; otherwise `fetch` downloads
the presigned URL from the job result). Producer-only knobs: `LTX_CLIENT` (the name quotas are counted under),
`LTX_MAX_QUEUE_DEPTH`, `LTX_CLIENT_QUOTA`, `LTX_JOB_TIMEOUT`, `LTX_TENANT_IDS`. Redis credentials and TLS:
`LTX_REDIS_USERNAME`, `LTX_REDIS_PASSWORD(_FILE)`, `LTX_REDIS_CA_FILE` (`ltx_contract.redis_conn`). Unknown
`LTX_*` variables are ignored, so the worker's variables can live in the same file. Credentials are
`SecretStr` and never printed.
"""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ltx_contract.keys import check_tenant_name
from ltx_contract.redis_conn import ServiceAccess
from ltx_contract.shared_settings import S3_SECRET_FILE_FIELDS, read_secret_file
from producer.admission import check_client_name
from producer.errors import ProducerError

__all__ = ["ENV_PREFIX", "ProducerSettings", "ProducerSettingsError", "load_settings"]

ENV_PREFIX = "LTX_"


class ProducerSettingsError(ProducerError, ValueError):
    """Invalid producer settings; the message names the field and its environment variable."""


def _default_client() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return "anonymous"


class ProducerSettings(ServiceAccess, BaseSettings):
    """Field `x` is environment variable `LTX_X`; CLI flags override. The `redis_*` credential and TLS
    fields, and the checks of `redis_url` and `queues`, come from `ltx_contract.redis_conn.ServiceAccess`
    (shared with the worker)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        case_sensitive=False,
        hide_input_in_errors=True,  # (secrets)
    )

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="the service's Redis")
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["ltx-render"],
        description="the worker's queues; `submit` uses the first unless --queue is given",
    )
    client: str = Field(default_factory=_default_client, description="name per-client quotas count under")
    operator: bool = Field(
        False,
        description="see and act on every client's jobs (ls, status, watch, cancel, fetch, stats' failures); "
        "otherwise only this client's own (and unowned) jobs",
    )
    tenant_ids: bool | None = Field(
        None,
        description="prefix every job id with '<client>-' (what a tenant Redis user may write); unset: on when "
        "redis_username is set and operator is off. The client name then defaults to redis_username and must "
        "be 1-32 letters, digits or _",
    )
    max_queue_depth: int = Field(
        200, ge=0, description="refuse a submit when this many jobs wait in the queue (0: no cap)"
    )
    client_quota: int = Field(
        0, ge=0, description="refuse a submit when the client has this many unfinished jobs (0: no quota)"
    )
    job_timeout: int = Field(
        7200, ge=1, description="RQ job_timeout written at submit (the worker replaces it with its own)"
    )
    result_ttl: int = Field(86400, ge=-1, description="seconds a finished job and its result stay in Redis")
    failure_ttl: int = Field(7 * 86400, ge=1, description="seconds a failed job stays in Redis")

    s3_endpoint_url: str | None = Field(None, description="S3 endpoint for `fetch` (unset: AWS)")
    s3_public_endpoint_url: str | None = Field(
        None,
        description="where the workers' presigned URLs point (their LTX_S3_PUBLIC_ENDPOINT_URL); `fetch` "
        "downloads a URL only from this or s3_endpoint_url (neither set: AWS S3), over http(s)",
    )
    local_storage_dir: Path | None = Field(
        None,
        description="the worker's local storage directory (storage_backend=local on this machine): `fetch` "
        "copies a file:// result only from under it",
    )
    s3_region: str = "us-east-1"
    s3_access_key_id: SecretStr | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_access_key_id_file: Path | None = Field(None, description="read the access key id from this file")
    s3_secret_access_key_file: Path | None = Field(None, description="read the secret key from this file")

    @field_validator("client")
    @classmethod
    def _check_client(cls, value: str) -> str:
        return check_client_name(value)

    @model_validator(mode="after")
    def _read_secret_files(self) -> ProducerSettings:
        """`*_FILE` variables (compose secrets: the producer's read-only S3 key) win over the plain ones."""
        for secret, file_field in S3_SECRET_FILE_FIELDS:
            path = getattr(self, file_field)
            if path is not None:
                object.__setattr__(self, secret, SecretStr(read_secret_file(path, file_field)))
        return self

    @model_validator(mode="after")
    def _tenant_defaults(self) -> ProducerSettings:
        if self.tenant_ids is None:
            object.__setattr__(self, "tenant_ids", self.redis_username is not None and not self.operator)
        if self.tenant_ids:
            if "client" not in self.model_fields_set and self.redis_username is not None:
                object.__setattr__(self, "client", self.redis_username)
            check_tenant_name(self.client)
        return self

    @property
    def default_queue(self) -> str:
        return self.queues[0]

    @property
    def has_s3_credentials(self) -> bool:
        return self.s3_access_key_id is not None and self.s3_secret_access_key is not None


def load_settings(**overrides: Any) -> ProducerSettings:
    """Settings from the environment with CLI overrides (None = not given); raise ProducerSettingsError."""
    try:
        return ProducerSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else "settings"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ProducerSettingsError(f"invalid setting {field} ({ENV_PREFIX}{field.upper()}): {msg}") from None
