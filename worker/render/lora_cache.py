"""`LoraCache`: the worker's on-disk cache of checked request-LoRA files, shared by its fleets (processes).

Files are named by content (`sha256` of a catalogue file, `ETag`+size of an S3 object, with the tenant), so a
LoRA replaced under the same name is a new file and the tracker's per-path factor memo can never serve stale
weights. Writes are atomic (a temporary file in the same folder, `os.replace`).

The caps hold always, not only after a commit, on bytes (`cap_bytes`) and on files (`cap_files`: a file
takes an inode whatever its size, and tiny LoRAs under new keys exhausted a small spool's inodes while the
byte cap held): a fetch is admitted (`incoming(nbytes)`) only after least recently used files are evicted
to make room for it under both caps, and with the disk keeping `min_free_bytes` and `min_free_inodes` free
(the spool's back-pressure thresholds: the cache never pushes the spool into them); if even evicting every
file not pinned cannot make room, `LoraCacheFull` (an `OSError`, ENOSPC) refuses the fetch (`wait_s`: after
trying again for that long, others' jobs ending meanwhile). A file is pinned while a job uses it: its
process holds a shared `flock` on it (`get`, `commit`; released by `release`), and eviction skips a file it
cannot lock exclusively, in any process. A fetch in flight is a `.incoming-<bytes>-*` file counted at its
reserved size; one whose process died (no lock) is removed. `make_room` lets the spool reclaim bytes and
inodes: the worker calls it while in back-pressure (a restarted worker too: a dead process pins nothing).

Shares: every worker process that serves request LoRAs `join`s the cache (a `.member-*` file it holds a
shared lock on while it lives; a dead one's is removed), and one job may hold at most `share()`, the caps
over the processes sharing the folder, so each group's job always finds room once unpinned files go.

Durability off the job's path: a fetched file is renamed in and used at once, and fsynced afterwards on a
background thread, which then marks the file durable (an extended attribute). Why: an fsync of a LoRA takes
time that grows with its size (tenths of a second for 1.7 GB), which must not be spent inside its first use.
Why this is safe: until the machine stops, every process reads the file from the page cache, whole. After
a crash, a file written in an earlier boot and never marked durable may be torn: `get` drops it (a miss:
fetched again). Where the folder takes no extended attributes, or the boot time is unknown, `commit`
fsyncs before the rename.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from worker.errors import WorkerError

__all__ = ["LoraCache", "LoraCacheFull", "boot_time"]

_SUFFIX = ".safetensors"
_INCOMING = ".incoming-"  #: + "<reserved bytes>-<random>" + _SUFFIX: a fetch in flight
_MEMBER = ".member-"  #: + "<random>": a live process sharing the cache (holds a shared lock on it)
_ROOM_POLL_S = 0.25  #: how often `incoming(wait_s=...)` tries again
_NO_INODE_LIMIT = 1 << 30  #: what a file system that counts no inodes (statvfs f_files 0) offers
_DURABLE_XATTR = "user.ltx_mgpu.durable"  #: set on a cache file once its bytes are fsynced
log = logging.getLogger("worker.render.lora_cache")


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


class LoraCacheFull(WorkerError, OSError):
    """No room for a fetch now: a cap (or the disk's free-space floor) cannot be kept even after evicting every
    file no job pins. An `OSError` (ENOSPC): a host condition, never `internal`; the service re-queues the job
    to wait for room (`worker.jobs.ends.Failure.no_room`)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


class LoraCache:
    """Content-named checked LoRA files in one folder, capped in bytes and files at all times, least recently
    used evicted first, files in use pinned (see the module docstring)."""

    def __init__(
        self,
        root: Path | str,
        cap_bytes: int,
        *,
        cap_files: int = 1 << 20,
        min_free_bytes: int = 0,
        min_free_inodes: int = 0,
    ) -> None:
        self.root = Path(root)
        self.cap_bytes = int(cap_bytes)
        self.cap_files = int(cap_files)
        self.min_free_bytes = int(min_free_bytes)
        self.min_free_inodes = int(min_free_inodes)
        self._member: int | None = None  # the fd holding this process's `.member-` lock (`join`)
        # (the folder is made at the first fetch or `join`: a worker that serves no request LoRAs leaves
        # nothing behind, the demo's TMPDIR included)
        self.boot_time = boot_time()
        self._xattrs: bool | None = None  # whether the folder's file system keeps user xattrs (probed once)
        self._syncing: set[Path] = set()  # committed here, not yet durable
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pins: dict[int, int] = {}  # inode -> fd holding a shared flock (this process's pins)

    def path_for(self, key: str) -> Path:
        return self.root / f"{key}{_SUFFIX}"

    def get(self, key: str) -> Path | None:
        """The cached file, pinned and marked as just used; None on a miss (a file from an earlier boot never
        made durable counts as one, and is removed: it may be torn)."""
        path = self.path_for(key)
        if not self.root.is_dir():
            return None
        with self._locked():  # (no eviction between the lookup and the pin)
            try:
                if not self._trusted(path):
                    log.warning(
                        "LoRA cache: %s was written before the last boot and never fsynced; fetching again", path
                    )
                    path.unlink()
                    return None
                self._pin(path)
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

    # ---- pins ---------------------------------------------------------------------------------------------
    def _pin(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        ino = os.fstat(fd).st_ino
        if ino in self._pins:
            os.close(fd)
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._pins[ino] = fd

    def release(self) -> None:
        """Unpin every file this process pinned (the job that used them ended, or the next one starts)."""
        pins, self._pins = self._pins, {}
        for fd in pins.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def _pinned_elsewhere(path: Path) -> bool:
        """Whether some open file holds a flock on `path` (a pin, in this process or another)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # (closing drops the probe's lock)
        return False

    # ---- shares ---------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Count this process among those sharing the cache (idempotent; the lock goes with the process)."""
        if self._member is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, _ = tempfile.mkstemp(prefix=_MEMBER, dir=self.root)
        except OSError as exc:  # (a full disk: the worker starts anyway, and joins at its first LoRA job)
            log.warning("LoRA cache: cannot join %s yet (%s); counted once it can", self.root, exc)
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._member = fd

    def share(self) -> tuple[int, int, int]:
        """(bytes, files) one job may hold, and how many live processes share the cache (this one joins): the
        caps divided among them, so every group's job finds room whatever the others' jobs pin."""
        self.join()
        with self._locked():
            sharing = max(1, self._live_members())
        return self.cap_bytes // sharing, self.cap_files // sharing, sharing

    def _live_members(self) -> int:
        """Under the folder lock: the processes sharing the cache; a dead one's file is removed (an inode back)."""
        live = 0
        for p in self.root.glob(f"{_MEMBER}*"):
            if self._pinned_elsewhere(p):
                live += 1
            else:  # its process died
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return live

    # ---- admission and eviction ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def incoming(self, nbytes: int, *, wait_s: float = 0.0) -> Iterator[Path]:
        """A temporary path for a file of `nbytes` in the cache folder (same file system, so `commit` is an
        atomic rename), admitted only with room for it: see the module docstring. `LoraCacheFull` if none
        comes within `wait_s` seconds."""
        nbytes = max(0, int(nbytes))
        if nbytes > self.cap_bytes:
            raise LoraCacheFull(
                f"LoRA cache: {nbytes} bytes do not fit its cap of {self.cap_bytes} (LTX_LORA_CACHE_BYTES)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                with self._locked():
                    self._evict(need_bytes=nbytes, need_files=1, why="fetch")
                    fd, name = tempfile.mkstemp(prefix=f"{_INCOMING}{nbytes}-", suffix=_SUFFIX, dir=self.root)
                    fcntl.flock(fd, fcntl.LOCK_SH)  # (alive: no other process takes it for a dead fetch's leftover)
                break
            except LoraCacheFull:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_ROOM_POLL_S)  # (outside the folder lock: the jobs pinning files end meanwhile)
        try:
            yield Path(name)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def commit(self, tmp: Path, key: str) -> Path:
        """Move a checked temporary file in under `key`, pinned (fsynced in the background: module docstring)."""
        later = self._durable_later()
        if not later:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        path = self.path_for(key)
        with self._locked():
            os.replace(tmp, path)
            self._pin(path)
        if later:
            with self._cond:
                self._syncing.add(path)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._sync_loop, name="lora-cache-fsync", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        return path

    def usage(self) -> int:
        """Bytes the folder holds, fetches in flight counted at their reserved size."""
        if not self.root.is_dir():
            return 0
        committed, reserved = self._entries()
        return sum(size for _, size, _ in committed) + sum(size for size, _ in reserved)

    def files(self) -> int:
        """Files the folder holds against `cap_files` (fetches in flight included)."""
        if not self.root.is_dir():
            return 0
        committed, reserved = self._entries()
        return len(committed) + len(reserved)

    def make_room(self, free_bytes: int, free_inodes: int = 0) -> list[Path]:
        """Evict unpinned files, least recently used first, until the folder's disk has `free_bytes` and
        `free_inodes` free (the spool needs them: the worker calls this in back-pressure). Returns what was
        removed."""
        if not self.root.is_dir():
            return []
        with self._locked():
            return self._evict(why="spool", floors=(int(free_bytes), int(free_inodes)), strict=False)

    def evict(self) -> list[Path]:
        """Evict unpinned files, least recently used first, down to the caps. Returns what was removed."""
        if not self.root.is_dir():
            return []
        with self._locked():
            return self._evict(why="cap", strict=False)

    def _entries(self) -> tuple[list[tuple[float, int, Path]], list[tuple[int, Path]]]:
        committed: list[tuple[float, int, Path]] = []
        reserved: list[tuple[int, Path]] = []
        for p in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if p.name.startswith(_INCOMING):
                    head = p.name[len(_INCOMING) :].split("-", 1)[0]
                    size = p.stat().st_size
                    reserved.append((max(size, int(head)) if head.isdigit() else size, p))
                elif p.name.endswith(_SUFFIX) and not p.name.startswith("."):
                    st = p.stat()
                    committed.append((st.st_mtime, st.st_size, p))
        return committed, reserved

    def _disk_free(self) -> tuple[int, int]:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_favail if st.f_files else _NO_INODE_LIMIT

    def _evict(
        self,
        *,
        why: str,
        need_bytes: int = 0,
        need_files: int = 0,
        floors: tuple[int, int] | None = None,
        strict: bool = True,
    ) -> list[Path]:
        """Under the folder lock: remove dead fetches' and processes' leftovers, then unpinned files (least
        recently used first) until `need_bytes` in `need_files` more fit under the caps and leave `floors` (free
        bytes and inodes; default `min_free_bytes`, `min_free_inodes`) free on the disk. `strict`:
        `LoraCacheFull` if that cannot be reached."""
        floor_bytes, floor_inodes = floors or (self.min_free_bytes, self.min_free_inodes)
        self._live_members()  # (dead processes' files go too)
        committed, reserved = self._entries()
        removed: list[Path] = []
        for _size, p in reserved:
            if not self._pinned_elsewhere(p):  # its fetch's process died
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
        left = [(s, p) for s, p in reserved if p not in removed]
        total, files = sum(size for _, size, _ in committed) + sum(s for s, _ in left), len(committed) + len(left)
        free, inodes = self._disk_free()

        def fits() -> bool:
            return (
                total + need_bytes <= self.cap_bytes
                and files + need_files <= self.cap_files
                and free - need_bytes >= floor_bytes
                and inodes - need_files >= floor_inodes
            )

        for _, size, p in sorted(committed, key=lambda f: f[0]):
            if fits():
                break
            if self._pinned_elsewhere(p):
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
                total, files, free, inodes = total - size, files - 1, free + size, inodes + 1
        if removed:
            log.info(
                "LoRA cache: evicted %d file(s) (%s); %d bytes in %d files cached, %d bytes and %d inodes free "
                "on its disk",
                len(removed),
                why,
                total,
                files,
                free,
                inodes,
            )
        if strict and not fits():
            raise LoraCacheFull(self._full(total, files, free, inodes, need_bytes, floor_bytes, floor_inodes))
        return removed

    def _full(self, total: int, files: int, free: int, inodes: int, need: int, floor: int, floor_inodes: int) -> str:
        """Why a fetch of `need` bytes cannot be admitted now (what is left is pinned by jobs or in flight)."""
        if total + need > self.cap_bytes:
            return (
                f"LoRA cache full: {need} bytes do not fit beside {total} bytes in use under its cap of "
                f"{self.cap_bytes} (LTX_LORA_CACHE_BYTES)"
            )
        if files + 1 > self.cap_files:
            return f"LoRA cache full: {files} files in use, its cap is {self.cap_files} (LTX_LORA_CACHE_FILES)"
        if free - need < floor:
            return (
                f"LoRA cache: {need} bytes would leave {free - need} bytes free on its disk, under the spool's "
                f"floor of {floor} (LTX_SPOOL_MIN_FREE_BYTES)"
            )
        return (
            f"LoRA cache: another file would leave {inodes - 1} inodes free on its disk, under the spool's "
            f"floor of {floor_inodes} (LTX_SPOOL_MIN_FREE_INODES)"
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The folder's lock, held on the folder itself: a lock file would need an inode, and a disk whose
        inodes are all taken must still let the cache evict for the spool."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (drops the lock)
