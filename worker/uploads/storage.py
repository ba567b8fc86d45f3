"""Where finished videos go: an S3-compatible bucket (boto3 managed transfer) or a local directory.

A storage backend does one *attempt* per `put()`; retries with back-off live in `worker/uploads/uploader.py`, so
both backends share them. Every put is idempotent: the key is fixed when the render is committed to the
spool and recorded in its manifest (every attempt, and a re-upload after a restart, writes the same object),
and an object that already holds the same sha256 is not uploaded again.

Object keys are `<prefix><render id>/<job id>/<file>`, the render id a random token the worker draws when it
commits a render (`new_render_id`). Why not per job id alone: a job id reused after the first job expired
overwrote the first submission's video. Why the render id first: every tenant reads with the same S3 key, and
a `HEAD <prefix><job id>/` answered 200 for any job that had a video, confirming another tenant's job id;
under an unguessable first folder, no key a client can build from a job id names anything. Why not an id from
Redis (a token kept in the job's meta, or RQ's `created_at`): whoever enqueues writes the job hash, so a
hostile client could copy another submission's value there and steer its render onto that submission's object.
The render id never leaves the worker before the object exists (it is in the local spool manifest, then in the
result), so no client can choose it. A re-render (the spool copy lost with its host) gets a new key: its bytes
differ anyway. A put is *confirmed* only after the stored object has been read back (size and sha256 metadata
match); the spool deletes its copy only after that.

S3 notes (measured against SeaweedFS, MinIO and AWS behaviour):
- multipart above `upload_multipart_threshold`, parts of `upload_multipart_chunksize`, threads per file;
- our own sha256 goes into the object metadata (`x-amz-meta-sha256`): multipart ETags are not MD5s;
- for non-AWS endpoints boto3 >= 1.36's default CRC checksums are turned down to "when_required";
- presigned URLs sign the Host header, so they are made by a second client configured for the
  *public* endpoint (what clients outside the compose network use), never by rewriting the host.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from ltx_contract.s3_errors import s3_error_text
from worker.errors import WorkerError
from worker.settings import WorkerSettings
from worker.uploads.spool import SpoolEntry, sha256_file

__all__ = ["LocalStorage", "S3Storage", "Storage", "StorageError", "StoredObject", "make_storage", "new_render_id"]


log = logging.getLogger("worker.uploads.storage")

ProgressFn = Callable[[int], None]  # called with byte increments, from transfer threads
#: CreateBucket errors that mean the bucket is already there (a sibling worker won the race, or the name is
#: taken): checked with a HeadBucket rather than taken as fatal.
_BUCKET_EXISTS_CODES = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})


class StorageError(WorkerError, RuntimeError):
    """An upload attempt failed or could not be confirmed; `retryable` says whether trying again helps."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class StoredObject:
    """A confirmed object. `to_json()` is what the job result reports."""

    backend: str  #: "s3" or "local"
    bucket: str | None
    key: str
    size: int
    sha256: str
    content_type: str
    url: str  #: presigned GET URL (s3) or file:// URL (local)
    url_expires_at: float | None  #: wall-clock seconds, or None when the URL does not expire
    reused: bool  #: True when an identical object was already there (no bytes sent)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def new_render_id() -> str:
    """A fresh render id for an object key: 64 random bits from the OS (see the module docstring)."""
    return secrets.token_hex(8)


def _key(prefix: str, job_id: str, render_id: str, file_name: str) -> str:
    return f"{prefix}{render_id}/{job_id}/{file_name}"


class Storage(Protocol):
    name: str

    def key_for(self, job_id: str, render_id: str, file_name: str) -> str:
        """The object key of one render of a job (`render_id`: from `new_render_id()`)."""

    def check(self) -> None:
        """Fail fast at start if the destination is unusable (bucket missing, directory unwritable).
        Raises StorageError: `retryable=False` for a configuration error, `retryable=True` for a transient
        one (endpoint unreachable), which the worker survives (it starts with storage `degraded`)."""

    def put(self, entry: SpoolEntry, progress: ProgressFn | None = None) -> StoredObject:
        """One idempotent upload attempt, confirmed by reading the object back. Raises StorageError."""

    def url_for(self, key: str, expiry_s: int | None = None) -> tuple[str, float | None]:
        """A URL clients can read the object at and when it expires (None: never); `expiry_s` shortens a
        presigned URL's life below `presign_expiry_s` (never lengthens it)."""


def make_storage(settings: WorkerSettings) -> Storage:
    if settings.storage_backend == "local":
        assert settings.local_storage_dir is not None  # checked by the settings
        return LocalStorage(settings.local_storage_dir, prefix=settings.s3_prefix)
    return S3Storage(settings)


# ==== S3 ==================================================================================================


def _client_config(settings: WorkerSettings, *, max_attempts: int = 3) -> Any:
    from botocore.config import Config

    kwargs: dict[str, Any] = {
        "signature_version": "s3v4",
        "s3": {"addressing_style": settings.s3_addressing_style},
        "retries": {"mode": "standard", "max_attempts": max_attempts},
        "connect_timeout": settings.s3_connect_timeout,
        "read_timeout": settings.s3_read_timeout,
        "max_pool_connections": max(10, settings.upload_max_concurrency * 2),
    }
    if settings.checksum_when_required:
        kwargs["request_checksum_calculation"] = "when_required"
        kwargs["response_checksum_validation"] = "when_required"
    return Config(**kwargs)


class S3Storage:
    """S3-compatible bucket through boto3; see the module docstring."""

    name = "s3"

    def __init__(self, settings: WorkerSettings) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.settings = settings
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix
        creds: dict[str, str] = {}
        if settings.s3_access_key_id is not None and settings.s3_secret_access_key is not None:
            creds = {
                "aws_access_key_id": settings.s3_access_key_id.get_secret_value(),
                "aws_secret_access_key": settings.s3_secret_access_key.get_secret_value(),
            }
        session = boto3.session.Session(region_name=settings.s3_region, **creds)
        self.client = session.client("s3", endpoint_url=settings.s3_endpoint_url, config=_client_config(settings))
        public = settings.s3_public_endpoint_url or settings.s3_endpoint_url
        self.presign_client = (
            session.client("s3", endpoint_url=public, config=_client_config(settings))
            if public != settings.s3_endpoint_url
            else self.client
        )
        if settings.s3_presign_access_key_id is not None and settings.s3_presign_secret_access_key is not None:
            # URLs signed with a read-only key: the worker's (write) key id never reaches Redis or clients
            presign = boto3.session.Session(
                region_name=settings.s3_region,
                aws_access_key_id=settings.s3_presign_access_key_id.get_secret_value(),
                aws_secret_access_key=settings.s3_presign_secret_access_key.get_secret_value(),
            )
            self.presign_client = presign.client("s3", endpoint_url=public, config=_client_config(settings))
        #: result URLs carry the worker's own (read/write) key id: said once at start (`check`)
        self.presigns_with_worker_key = settings.s3_presign_access_key_id is None
        self.transfer_config = TransferConfig(
            multipart_threshold=settings.upload_multipart_threshold,
            multipart_chunksize=settings.upload_multipart_chunksize,
            max_concurrency=settings.upload_max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def key_for(self, job_id: str, render_id: str, file_name: str) -> str:
        return _key(self.prefix, job_id, render_id, file_name)

    def check(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        # Only a definite answer from the endpoint (a 4xx: bad credentials, no such bucket, access denied) is
        # a configuration error (`retryable=False`: the worker must not start). No answer at all (connection
        # refused/reset, timeouts) or a 5xx is transient (`retryable=True`): a worker (re)started during an S3
        # outage must start degraded, render into the spool and retry its uploads, not exit 2 until its
        # supervisor gives up and the whole service is down.
        where = f"bucket {self.bucket!r} at {self.settings.s3_endpoint_url}"
        if self.presigns_with_worker_key:
            log.warning(
                "result URLs are signed with the worker's own read/write S3 key: its key id is in every "
                "URL stored in Redis and shown to clients; set LTX_S3_PRESIGN_ACCESS_KEY_ID_FILE and "
                "LTX_S3_PRESIGN_SECRET_ACCESS_KEY_FILE to a read-only key (docs/security.md)"
            )
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in ("404", "NoSuchBucket", "NotFound") and self.settings.s3_create_bucket:
                self._create_bucket(where)
                return
            raise StorageError(f"{where}: {s3_error_text(exc)}", retryable=not (400 <= status < 500)) from exc
        except BotoCoreError as exc:
            message = f"S3 endpoint {self.settings.s3_endpoint_url} unreachable: {exc}"
            raise StorageError(message, retryable=True) from exc

    def _create_bucket(self, where: str) -> None:
        """Create the missing bucket. Workers of several groups start together against a fresh endpoint, so a
        sibling may create it between our HeadBucket and CreateBucket: "already exists" is success when a
        second HeadBucket shows the bucket is there and this key can use it (it is refused otherwise, e.g.
        AWS's BucketAlreadyExists for a name another account owns)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) not in _BUCKET_EXISTS_CODES:
                raise StorageError(f"{where}: cannot create it: {s3_error_text(exc)}", retryable=False) from exc
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as head_exc:
                message = f"{where}: it exists but this key cannot use it: {s3_error_text(head_exc)}"
                raise StorageError(message, retryable=False) from head_exc
            except BotoCoreError as head_exc:
                raise StorageError(f"{where}: unreachable: {head_exc}", retryable=True) from head_exc
        except BotoCoreError as exc:
            raise StorageError(f"{where}: unreachable: {exc}", retryable=True) from exc

    def _stat(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return {"size": int(head["ContentLength"]), "sha256": head.get("Metadata", {}).get("sha256")}

    def put(self, entry: SpoolEntry, progress: ProgressFn | None = None) -> StoredObject:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            existing = self._stat(entry.key)
            reused = existing == {"size": entry.size, "sha256": entry.sha256}
            if not reused:
                self.client.upload_file(
                    str(entry.path),
                    self.bucket,
                    entry.key,
                    ExtraArgs={
                        "ContentType": entry.content_type,
                        "Metadata": {"sha256": entry.sha256, "job-id": entry.job_id},
                    },
                    Config=self.transfer_config,
                    Callback=progress,
                )
            stored = self._stat(entry.key)
        except (BotoCoreError, ClientError, S3UploadFailedError, OSError) as exc:
            raise StorageError(f"upload of {entry.key} failed: {type(exc).__name__}: {exc}") from exc
        if stored != {"size": entry.size, "sha256": entry.sha256}:
            raise StorageError(f"upload of {entry.key} not confirmed: stored {stored}, expected size {entry.size}")
        url, expires = self.url_for(entry.key)
        return StoredObject(
            "s3", self.bucket, entry.key, entry.size, entry.sha256, entry.content_type, url, expires, reused
        )

    def url_for(self, key: str, expiry_s: int | None = None) -> tuple[str, float | None]:
        expiry = self.settings.presign_expiry_s
        if expiry_s is not None and 0 < expiry_s < expiry:
            expiry = int(expiry_s)
        url = self.presign_client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expiry
        )
        return url, time.time() + expiry


# ==== local directory =====================================================================================


class LocalStorage:
    """A directory standing in for a bucket (single machine, tests, the embedded default).

    Objects are copied to `<root>/<key>` via a temporary name and `os.replace` (atomic), with a
    `<key>.sha256` sidecar written after the object (its presence means "confirmed").
    """

    name = "local"

    def __init__(self, root: Path | str, *, prefix: str = "videos/") -> None:
        self.root = Path(root)
        self.prefix = prefix

    def key_for(self, job_id: str, render_id: str, file_name: str) -> str:
        return _key(self.prefix, job_id, render_id, file_name)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"local storage {self.root} not writable: {exc}", retryable=False) from exc

    def put(self, entry: SpoolEntry, progress: ProgressFn | None = None) -> StoredObject:
        dest = self.root / entry.key
        sidecar = dest.with_name(dest.name + ".sha256")
        try:
            reused = dest.exists() and sidecar.exists() and sidecar.read_text().strip() == entry.sha256
            if not reused:
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                shutil.copyfile(entry.path, tmp)
                os.replace(tmp, dest)
                if sha256_file(dest) != entry.sha256:
                    raise StorageError(f"copy of {entry.key} does not match its sha256")
                sidecar.write_text(entry.sha256 + "\n")
                if progress is not None:
                    progress(entry.size)
        except OSError as exc:
            raise StorageError(f"copy of {entry.key} failed: {exc}") from exc
        url, expires = self.url_for(entry.key)
        return StoredObject(
            "local", None, entry.key, entry.size, entry.sha256, entry.content_type, url, expires, reused
        )

    def url_for(self, key: str, expiry_s: int | None = None) -> tuple[str, float | None]:
        return (self.root / key).resolve().as_uri(), None
