"""What every settings module shares: the environment prefix, the settings-file variable, the error."""

from __future__ import annotations

from worker.errors import WorkerError

__all__ = ["ENV_PREFIX", "MIB", "SETTINGS_FILE_ENV", "SettingsError"]

ENV_PREFIX = "LTX_"
SETTINGS_FILE_ENV = "LTX_SETTINGS_FILE"
MIB = 1024 * 1024


class SettingsError(WorkerError, ValueError):
    """Settings are invalid; the message names each offending field and its environment variable."""
