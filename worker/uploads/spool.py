"""The local spool: where a finished render waits until storage has confirmed it.

Layout (one directory per job, so a job's files are removed with one `rmtree`):

    <spool_dir>/<job_id>/<output_name>     the video, written by the fleet's driver rank
    <spool_dir>/<job_id>/manifest.json     written atomically once the render is complete

A directory without a manifest is a render in progress (or one that died): it is discarded when the job
is re-run. A directory *with* a manifest is a complete video that has not been confirmed by storage yet:
it is never deleted except by `release()` after a confirmed upload. That is what makes "the video is never
lost" hold across upload failures, worker crashes and restarts: a re-run of the same job finds the
manifest and uploads instead of rendering again, and a worker can list `pending()` entries at start.

The manifest carries everything an uploader needs without Redis (key, sha256, size, content type, job
and queue ids), so the background uploader (`worker/stages/upload.py`) can be fed from `pending()` alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "Spool", "SpoolEntry", "sha256_file"]

MANIFEST_NAME = "manifest.json"
_MANIFEST_VERSION = 1
_JOB_ID_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file (streamed; hashlib releases the GIL on large blocks)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@dataclass(frozen=True)
class SpoolEntry:
    """A complete render waiting for (or in) upload. Serialised as the job's manifest.json."""

    job_id: str
    file_name: str  #: the video's file name inside the job directory
    size: int  #: bytes
    sha256: str  #: hex digest of the file, computed once (at commit, or by the background uploader: "" until then)
    content_type: str
    key: str  #: storage key, fixed at commit (job id + a random render id): every upload attempt writes it
    created_at: float  #: wall-clock seconds at commit
    queue: str | None = None  #: the RQ queue the job came from (recovery updates the job there)
    info: dict[str, Any] = field(default_factory=dict)  #: output facts (frames, fps, size) and render timings
    attempts: int = 0  #: upload attempts so far (across workers)
    last_error: str | None = None
    directory: str = ""  #: absolute job directory (filled in on load; not trusted from the file)
    #: which submission of `job_id` rendered it (the job hash's RQ `created_at`, kept across re-queues and
    #: retries of that job): a later submission that reuses the id is another job and must not take this
    #: video over (`belongs_to`); None in manifests written before it was recorded. It guards against an
    #: id reused by accident; copying it on purpose needs the old hash, which with tenant ACLs only the
    #: id's own tenant could read or create
    submission: str | None = None

    def belongs_to(self, submission: str | None) -> bool:
        """True unless both submissions are known and differ."""
        return self.submission is None or submission is None or self.submission == submission

    @property
    def path(self) -> Path:
        return Path(self.directory) / self.file_name

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("directory")
        data["version"] = _MANIFEST_VERSION
        return data


class Spool:
    """A directory of per-job subdirectories; see the module docstring for the layout and invariants."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- paths ---------------------------------------------------------------------------------------
    def job_dir(self, job_id: str) -> Path:
        if not job_id or not set(job_id) <= _JOB_ID_SAFE:
            raise ValueError(f"job id {job_id!r} is not safe as a directory name")
        return self.root / job_id

    def prepare(self, job_id: str, file_name: str) -> Path:
        """The path the fleet should write to, in a fresh job directory (any partial render is removed).

        Must not be called when `load(job_id)` returns an entry: that video is complete and unconfirmed.
        """
        directory = self.job_dir(job_id)
        if (directory / MANIFEST_NAME).exists():
            raise FileExistsError(f"spool already holds a complete render of job {job_id}; upload it instead")
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        return directory / file_name

    # ---- manifests -----------------------------------------------------------------------------------
    def commit(
        self,
        job_id: str,
        *,
        file_name: str,
        key: str,
        content_type: str,
        queue: str | None = None,
        info: dict[str, Any] | None = None,
        hash_now: bool = True,
        submission: str | None = None,
    ) -> SpoolEntry:
        """Record a finished render: hash it and write the manifest atomically. Returns the entry.

        `hash_now=False` (the background uploader's path) leaves `sha256` empty so the ~30 ms per 50 MB of
        hashing happens off the fleet's critical path; `ensure_sha256()` fills it in before any upload.
        The manifest still marks the render complete (size recorded, so `load()` rejects a torn file)."""
        directory = self.job_dir(job_id)
        path = directory / file_name
        stat = path.stat()
        entry = SpoolEntry(
            job_id=job_id,
            file_name=file_name,
            size=stat.st_size,
            sha256=sha256_file(path) if hash_now else "",
            content_type=content_type,
            key=key,
            created_at=time.time(),
            queue=queue,
            info=dict(info or {}),
            directory=str(directory),
            submission=submission,
        )
        self._write_manifest(entry)
        return entry

    def update(self, entry: SpoolEntry, **changes: Any) -> SpoolEntry:
        """Rewrite the manifest with some fields changed (e.g. attempts, last_error)."""
        new = replace(entry, **changes)
        self._write_manifest(new)
        return new

    def ensure_sha256(self, entry: SpoolEntry) -> SpoolEntry:
        """The entry with its sha256 computed and recorded in the manifest (a no-op when already known)."""
        if entry.sha256:
            return entry
        return self.update(entry, sha256=sha256_file(entry.path))

    def load(self, job_id: str) -> SpoolEntry | None:
        """The complete render of `job_id`, if the spool holds one whose file is intact (size matches)."""
        directory = self.job_dir(job_id)
        return self._load_dir(directory)

    def pending(self) -> list[SpoolEntry]:
        """Every complete, unconfirmed render, oldest first."""
        entries = []
        for directory in self.root.iterdir():
            if directory.is_dir():
                entry = self._load_dir(directory)
                if entry is not None:
                    entries.append(entry)
        return sorted(entries, key=lambda e: e.created_at)

    def usage(self) -> tuple[int, int]:
        """(number of complete unconfirmed renders, their total bytes)."""
        entries = self.pending()
        return len(entries), sum(e.size for e in entries)

    # ---- ownership -----------------------------------------------------------------------------------
    def claim(self, job_id: str) -> int | None:
        """Take exclusive ownership of a job's spool entry for this process; returns the lock's file
        descriptor (pass it to `unclaim`), or None if another process holds it.

        Why: every worker process of a host shares the spool, and a worker's start-up recovery lists *all*
        complete entries, including the ones another live worker is uploading right now; without a lock two
        processes would upload and record the same job (two terminal events). The lock is an
        `flock` on `<job_dir>/.owner`, so the kernel drops it when its process dies (SIGKILL included) and
        the entry becomes recoverable at once."""
        directory = self.job_dir(job_id)
        try:
            fd = os.open(directory / ".owner", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unclaim(fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    def free(self) -> tuple[int, int]:
        """Bytes and inodes an unprivileged writer can still use on the spool's file system."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_favail if st.f_files else 1 << 30  # (some file systems: no inodes)

    # ---- removal -------------------------------------------------------------------------------------
    def release(self, entry: SpoolEntry) -> None:
        """Delete a render whose upload storage has confirmed. Only call it after confirmation."""
        shutil.rmtree(self.job_dir(entry.job_id), ignore_errors=True)

    def discard_incomplete(self, job_id: str) -> None:
        """Remove a job directory that has no manifest (a failed or cancelled render). Complete renders
        are kept: they are removed only by `release()`."""
        directory = self.job_dir(job_id)
        if directory.exists() and not (directory / MANIFEST_NAME).exists():
            shutil.rmtree(directory, ignore_errors=True)

    # ---- internals -----------------------------------------------------------------------------------
    def _write_manifest(self, entry: SpoolEntry) -> None:
        directory = Path(entry.directory) if entry.directory else self.job_dir(entry.job_id)
        tmp = directory / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
        data = json.dumps(entry.to_json(), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / MANIFEST_NAME)
        with contextlib.suppress(OSError):  # make the rename itself durable
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _load_dir(self, directory: Path) -> SpoolEntry | None:
        manifest = directory / MANIFEST_NAME
        try:
            data = json.loads(manifest.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # a torn manifest cannot happen (atomic rename); treat as absent but keep files
        data.pop("version", None)
        data["directory"] = str(directory)
        try:
            entry = SpoolEntry(**data)
        except TypeError:
            return None
        try:
            if entry.path.stat().st_size != entry.size:
                return None
        except FileNotFoundError:
            return None
        return entry
