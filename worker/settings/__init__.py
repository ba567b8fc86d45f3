"""Worker settings: environment variables (prefix `LTX_`), an optional settings file, CLI overrides.

Below every worker folder but `protocol` (tests/test_import_contracts.py holds the order), so each layer
that needs a knob imports it from here. Public API: `WorkerSettings` (every field; `core`), `load_settings`,
`SettingsError`, `ENV_PREFIX`, `SETTINGS_FILE_ENV`, the runner registry (`BUILTIN_RUNNERS`,
`resolve_runner`) and the device-group helpers (`validate_group`, `group_label`).

Fields are grouped by topic, one module each, and joined into `WorkerSettings` (`worker.settings.core`):
`queues` (Redis/RQ, tenants, admission), `fleets` (device groups, the runner, fleet life, retries),
`storage` (storage, spool, uploads, the encoder), `loras`, `observability`. Field `x` is environment variable
`LTX_X`. Credentials come from the environment or from files (`*_FILE`), never from requests, and are never
logged (they are `SecretStr`; `public_dump()` masks them).
"""

from __future__ import annotations

from worker.settings.base import ENV_PREFIX, SETTINGS_FILE_ENV, SettingsError
from worker.settings.core import WorkerSettings, load_settings
from worker.settings.fleets import BUILTIN_RUNNERS, group_label, resolve_runner, validate_group

__all__ = [
    "BUILTIN_RUNNERS",
    "ENV_PREFIX",
    "SETTINGS_FILE_ENV",
    "SettingsError",
    "WorkerSettings",
    "group_label",
    "load_settings",
    "resolve_runner",
    "validate_group",
]
