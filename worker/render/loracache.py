"""`LoraCache`: the worker's on-disk cache of checked request-LoRA files, shared by its fleets (processes).

Files are named by content (`sha256` of a catalogue file, `ETag`+size of an S3 object), so a LoRA replaced under
the same name is a new file and the tracker's per-path factor memo can never serve stale weights. Writes are
atomic (a temporary file in the same folder, `os.replace`); the size cap is kept by evicting least recently
used files under an exclusive `flock`, sparing files used in the last `busy_s` seconds (a fleet may be about
to read them; the cap can then be exceeded briefly). Only files that passed the check are ever renamed in.

Durability off the job's path: a fetched file is renamed in and used at once, and fsynced afterwards on a
background thread, which then marks the file durable (an extended attribute). Why: an fsync of a 1.7 GB
LoRA took 0.2-0.63 s on the CPU VM, inside the first use of every LoRA (a commit now returns in 1 ms).
Why this is safe: until the machine stops, every process reads the file from the page cache, whole. After
a crash, a file written in an earlier boot and never marked durable may be torn: `get` drops it (a miss:
fetched again). Where the folder takes no extended attributes, or the boot time is unknown, `commit`
fsyncs before the rename, as it used to.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LoraCache", "boot_time"]

_SUFFIX = ".safetensors"
_DURABLE_XATTR = "user.ltx_mgpu.durable"  #: set on a cache file once its bytes are fsynced
log = logging.getLogger("worker.render.loracache")


def boot_time() -> float | None:
    """When this machine booted (Linux `/proc/stat` btime), None where unknown: a file last written before
    it was written in an earlier boot."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


class LoraCache:
    """Content-named checked LoRA files in one folder, size-capped, least recently used evicted first."""

    def __init__(self, root: Path | str, cap_bytes: int, *, busy_s: float = 600.0) -> None:
        self.root = Path(root)
        self.cap_bytes = int(cap_bytes)
        self.busy_s = float(busy_s)  # (the folder is made at the first fetch: a worker no request asks a LoRA of
        # leaves nothing behind, the demo's TMPDIR included)
        self.boot_time = boot_time()
        self._xattrs: bool | None = None  # whether the folder's file system keeps user xattrs (probed once)
        self._syncing: set[Path] = set()  # committed here, not yet durable
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def path_for(self, key: str) -> Path:
        return self.root / f"{key}{_SUFFIX}"

    def get(self, key: str) -> Path | None:
        """The cached file, marked as just used; None on a miss (a file from an earlier boot never made
        durable counts as one, and is removed: it may be torn)."""
        path = self.path_for(key)
        try:
            if not self._trusted(path):
                log.warning("LoRA cache: %s was written before the last boot and never fsynced; fetching again", path)
                path.unlink()
                return None
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    def _trusted(self, path: Path) -> bool:
        mtime = path.stat().st_mtime  # (FileNotFoundError: a miss)
        if not self._durable_later():
            return True  # (every file was fsynced before its rename)
        if mtime >= float(self.boot_time or 0) or path in self._syncing:
            return True
        try:
            return os.getxattr(path, _DURABLE_XATTR) == b"1"
        except OSError:
            return False

    def _durable_later(self) -> bool:
        """Whether commits may fsync in the background: the boot time is known and the folder keeps xattrs."""
        if self._xattrs is None:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".xattr-probe-", dir=self.root)
            os.close(fd)
            try:
                os.setxattr(probe, _DURABLE_XATTR, b"1")
                self._xattrs = os.getxattr(probe, _DURABLE_XATTR) == b"1"
            except (OSError, AttributeError):  # (no xattrs here, or not on this OS)
                self._xattrs = False
            finally:
                os.unlink(probe)
        return bool(self._xattrs) and self.boot_time is not None

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until every file committed here is fsynced and marked; True if so. (Nothing waits for it at a
        stop: an unmarked file is only fetched again if the machine reboots before its next use.)"""
        with self._cond:
            return self._cond.wait_for(lambda: not self._syncing, timeout)

    def _sync_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._syncing))
                path = next(iter(self._syncing))
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.setxattr(path, _DURABLE_XATTR, b"1")  # (only after its bytes are on disk)
                    os.fsync(fd)  # the attribute itself
                finally:
                    os.close(fd)
            except OSError:  # evicted or replaced meanwhile: nothing to keep
                pass
            with self._cond:
                self._syncing.discard(path)
                self._cond.notify_all()

    @contextlib.contextmanager
    def incoming(self) -> Iterator[Path]:
        """A temporary path in the cache folder (same file system, so `commit` is an atomic rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".incoming-", suffix=_SUFFIX, dir=self.root)
        os.close(fd)
        try:
            yield Path(name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def commit(self, tmp: Path, key: str) -> Path:
        """Move a checked temporary file in under `key` (fsynced in the background, see the module docstring),
        then evict down to the cap."""
        later = self._durable_later()
        if not later:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        path = self.path_for(key)
        os.replace(tmp, path)
        if later:
            with self._cond:
                self._syncing.add(path)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._sync_loop, name="lora-cache-fsync", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        self.evict(keep=path)
        return path

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove least recently used files until the folder is within the cap (see the module docstring)."""
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        with self._locked():
            files = []
            for p in self.root.glob(f"*{_SUFFIX}"):
                if p.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    files.append((st.st_mtime, st.st_size, p))
            total = sum(size for _, size, _ in files)
            now = time.time()
            for mtime, size, p in sorted(files, key=lambda f: f[0]):
                if total <= self.cap_bytes:
                    break
                if p == keep or now - mtime < self.busy_s:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
                total -= size
        return removed

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
