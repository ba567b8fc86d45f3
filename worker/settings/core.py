"""`WorkerSettings`: every field group of the package in one pydantic-settings class, its sources, its
cross-field checks, and `load_settings`.

Precedence, highest first: CLI flags → environment → settings file (`LTX_SETTINGS_FILE` or `--settings`;
`.json`, `.toml`, `.yaml`/`.yml`) → defaults. Invalid values fail at start with `SettingsError`, whose
message names the field and its environment variable, so a typo in a deployment never reaches a job.
The field groups are bases listed last-first: pydantic orders fields from the last base to the first, so
`model_fields` (and `ltx-worker settings`) reads Redis, fleets, storage, LoRAs, observability, in that order.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from ltx_contract.redis_conn import ServiceAccess
from ltx_contract.shared_settings import S3_SECRET_FILE_FIELDS, read_secret_file, safe_redis_url
from worker.settings.base import ENV_PREFIX, SETTINGS_FILE_ENV, SettingsError
from worker.settings.fleets import FleetFields, group_label
from worker.settings.loras import LoraFields
from worker.settings.observability import ObservabilityFields
from worker.settings.queues import QueueFields
from worker.settings.storage import PRESIGN_FILE_FIELDS, StorageFields

__all__ = ["WorkerSettings", "load_settings"]


class WorkerSettings(
    ObservabilityFields, LoraFields, StorageFields, FleetFields, QueueFields, ServiceAccess, BaseSettings
):
    """Every knob of a worker process. Field `x` is environment variable `LTX_X` (case-insensitive); the
    `redis_*` credential and TLS fields, and the checks of `redis_url` and `queues`, come from
    `ltx_contract.redis_conn.ServiceAccess`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
        hide_input_in_errors=True,  # a validation error must never print the Redis or S3 secrets
    )

    # ---- sources -------------------------------------------------------------------------------------
    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(SETTINGS_FILE_ENV)
        if path:
            sources.append(_file_source(settings_cls, Path(path)))
        return tuple(sources)

    # ---- validation ----------------------------------------------------------------------------------
    @model_validator(mode="after")
    def _check_cross_fields(self) -> WorkerSettings:
        if self.runner not in self.runner_registry:
            raise ValueError(
                f"runner ({ENV_PREFIX}RUNNER): {self.runner!r} is not registered; "
                f"known: {sorted(self.runner_registry)} (add one with {ENV_PREFIX}RUNNERS)"
            )
        if self.storage_backend == "local" and self.local_storage_dir is None:
            raise ValueError(
                f"local_storage_dir ({ENV_PREFIX}LOCAL_STORAGE_DIR) is required when storage_backend='local'"
            )
        for secret, file_field in (*S3_SECRET_FILE_FIELDS, *PRESIGN_FILE_FIELDS):
            path = getattr(self, file_field)
            if path is not None:
                object.__setattr__(self, secret, SecretStr(read_secret_file(path, file_field)))
        for key_id, secret in (
            ("s3_access_key_id", "s3_secret_access_key"),
            ("s3_presign_access_key_id", "s3_presign_secret_access_key"),
        ):
            if (getattr(self, key_id) is None) != (getattr(self, secret) is None):
                raise ValueError(
                    f"{key_id} / {secret} ({ENV_PREFIX}{key_id.upper()}, {ENV_PREFIX}{secret.upper()}): "
                    "set both or neither"
                )
        if self.tenants and not self.tenant_ids:
            raise ValueError(
                f"tenants ({ENV_PREFIX}TENANTS) need tenant_ids ({ENV_PREFIX}TENANT_IDS=true): a "
                "tenant queue holds only ids with its tenant's prefix"
            )
        if self.job_heartbeat_ttl < 3 * self.heartbeat_interval:
            # a running job is declared abandoned after this; two missed beats must never be enough
            raise ValueError(
                f"job_heartbeat_ttl ({ENV_PREFIX}JOB_HEARTBEAT_TTL) must be at least three times "
                f"heartbeat_interval ({ENV_PREFIX}HEARTBEAT_INTERVAL)"
            )
        return self

    # ---- derived -------------------------------------------------------------------------------------
    def worker_name_for(self, group: str) -> str:
        """A unique RQ worker name: <prefix>.<group label>.<pid>."""
        prefix = self.worker_name or socket.gethostname()
        return f"{prefix}.{group_label(group)}.{os.getpid()}"

    def public_dump(self) -> dict[str, Any]:
        """JSON-safe settings with secrets masked (for logs and `ltx-worker settings`)."""
        data = self.model_dump(mode="json")
        for key in (
            "s3_access_key_id",
            "s3_secret_access_key",
            "s3_presign_access_key_id",
            "s3_presign_secret_access_key",
            "redis_password",
        ):
            if data.get(key) is not None:
                data[key] = "**********"
        data["redis_url"] = safe_redis_url(self.redis_url)  # (its password)
        return data


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    suffix = path.suffix.lower()
    if not path.exists():
        raise SettingsError(f"settings file {path} ({SETTINGS_FILE_ENV}) does not exist")
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise SettingsError(f"settings file {path}: use .json, .toml or .yaml")


def load_settings(settings_file: str | Path | None = None, **overrides: Any) -> WorkerSettings:
    """Build settings from CLI overrides, the environment and the settings file; raise `SettingsError`.

    `settings_file` (e.g. from `--settings`) takes the place of `LTX_SETTINGS_FILE` for this call.
    """
    previous = os.environ.get(SETTINGS_FILE_ENV)
    if settings_file is not None:
        os.environ[SETTINGS_FILE_ENV] = str(settings_file)
    try:
        return WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(_format_errors(exc)) from None
    finally:
        if settings_file is not None:
            if previous is None:
                os.environ.pop(SETTINGS_FILE_ENV, None)
            else:
                os.environ[SETTINGS_FILE_ENV] = previous


def _format_errors(exc: ValidationError) -> str:
    lines = ["invalid worker settings:"]
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if not loc:  # a cross-field check: its message names the fields itself
            lines.append(f"  - {msg}")
            continue
        field, detail = loc[0], ".".join(loc[1:])
        where = f"{field} ({ENV_PREFIX}{field.upper()})"
        lines.append(f"  - {where}{'[' + detail + ']' if detail else ''}: {msg}")
    return "\n".join(lines)
