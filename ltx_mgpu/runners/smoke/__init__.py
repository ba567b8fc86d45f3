"""The smoke runner: tiny LTX-2 architecture, deterministic random weights, real SP render to mp4.

`SmokeRunner` (an `MGPURunner`), `ensure_smoke_checkpoint` (creates the tiny checkpoint into a cache dir).
"""

from __future__ import annotations

from .checkpoint import SmokeCheckpoint, default_cache_dir, ensure_smoke_checkpoint, tiny_transformer_config
from .runner import SmokeRunner

__all__ = ["SmokeCheckpoint", "SmokeRunner", "default_cache_dir", "ensure_smoke_checkpoint", "tiny_transformer_config"]
