"""Tiny LTX-2 checkpoints for tests, CI and GPU smoke runs: the synthetic `tiny` profile, written once into a
cache directory.

`ensure_tiny_ltx2()` returns the paths (`TinyLtx2`, the same `Ltx2Files` every profile uses) of a tiny
checkpoint set in the released layouts (monolith with transformer, video VAE, audio VAE decoder + vocoder and
text projection; x2 upsampler; distilled LoRA; Gemma 3 root with a locally built tokenizer), creating it on
first use. The directory name is a digest of the format version, the seed, the tiny configs and the
generator's own source, so an existing directory always holds the right files; every file is written to a
temporary name and renamed, so concurrent callers are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .synthetic import Ltx2Files, write_checkpoints
from .synthetic.profiles import tiny

__all__ = ["FORMAT_VERSION", "TinyLtx2", "ensure_tiny_ltx2", "tiny_ltx2_config"]

FORMAT_VERSION = 2  #: 2: audio VAE decoder + vocoder in the monolith, streamed seeded fills
TinyLtx2 = Ltx2Files  #: the paths of a tiny set (kept under this name for callers)


def tiny_ltx2_config() -> dict[str, Any]:
    """The tiny monolith's metadata config (transformer, vae, audio_vae, vocoder, gemma_text_config)."""
    return tiny().monolith_config


def default_cache_dir() -> Path:
    root = os.environ.get("LTX_MGPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ltx-mgpu")
    return Path(root) / "tiny-ltx2"


def _generator_sources() -> list[bytes]:
    here = Path(__file__).parent
    files = [*sorted((here / "synthetic").glob("*.py")), here / "text.py"]
    files += [here.parent / "common" / name for name in ("weights.py", "audio.py", "tiny.py")]
    return [p.read_bytes() for p in files]


def ensure_tiny_ltx2(cache_dir: str | Path | None = None, *, seed: int = 0) -> TinyLtx2:
    """Create (once) and return the tiny LTX-2 files under `cache_dir/<digest>/`; safe to race."""
    prof = tiny()
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, seed, prof.monolith_config], sort_keys=True).encode())
    for blob in _generator_sources():  # editing the generator can never leave stale files in a cache
        digest.update(blob)
    directory = Path(cache_dir or default_cache_dir()) / digest.hexdigest()[:12]
    files = Ltx2Files.under(directory)
    done = directory / ".complete"
    if not done.exists():
        write_checkpoints("tiny", directory, seed=seed, device="cpu", skip_existing=True)
        done.touch()
    return files
