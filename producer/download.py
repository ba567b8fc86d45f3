"""`ObjectDownloads`: the client's `fetch`: the job's video from S3 (with credentials), a presigned URL
(http(s) from the configured endpoint only, no redirects) or the local storage directory, verified
against the recorded sha256 before it gets its name."""

from __future__ import annotations

import contextlib
import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ltx_contract.states import JobState
from producer.models import (
    FetchRefused,
    FetchResult,
    IntegrityError,
    JobNotReady,
    ServiceUnavailable,
)


class ObjectDownloads:
    """Mixed into `ProducerClient` (uses its `settings` and `status`)."""

    # ---- fetch -------------------------------------------------------------------------------------
    def fetch(self, job_id: str, dest: Path, *, chunk: int = 1 << 20) -> FetchResult:
        """Download the job's video to `dest` and verify its sha256 (written to a temporary file next to
        `dest`, renamed only after the hash matched)."""
        info = self.status(job_id)
        if info.state != JobState.UPLOADED.value or not info.result:
            raise JobNotReady(job_id, info.state)
        result = info.result
        expected = str(result.get("sha256") or "")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with partial.open("wb") as out:
                source, stream = self._open_object(result)
                with contextlib.closing(stream):
                    while True:
                        block = stream.read(chunk)
                        if not block:
                            break
                        out.write(block)
                        digest.update(block)
                        size += len(block)
            actual = digest.hexdigest()
            if expected and actual != expected:
                raise IntegrityError(
                    f"sha256 mismatch for job {job_id}: expected {expected}, got {actual} ({size} bytes); "
                    f"nothing written to {dest}"
                )
            if not expected:
                raise IntegrityError(f"job {job_id}'s result records no sha256; refusing an unverified file")
            os.replace(partial, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return FetchResult(path=dest, size=size, sha256=actual, source=source)

    def _open_object(self, result: dict[str, Any]) -> tuple[str, Any]:
        """An open binary stream of the result's object: S3 with credentials if configured, else the
        presigned URL, else a local path (the worker's local storage backend)."""
        bucket, key = result.get("bucket"), result.get("key")
        s = self.settings
        if bucket and key and s.has_s3_credentials:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError

            client = boto3.client(
                "s3",
                endpoint_url=s.s3_endpoint_url,
                region_name=s.s3_region,
                aws_access_key_id=s.s3_access_key_id.get_secret_value() if s.s3_access_key_id else None,
                aws_secret_access_key=s.s3_secret_access_key.get_secret_value() if s.s3_secret_access_key else None,
                config=Config(
                    signature_version="s3v4",
                    s3={"addressing_style": "path"},
                    retries={"mode": "standard", "max_attempts": 5},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                ),
            )
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
            except (BotoCoreError, ClientError) as exc:
                from ltx_contract.s3_errors import s3_error_text

                raise ServiceUnavailable(f"cannot read s3://{bucket}/{key}: {s3_error_text(exc)}") from None
            return f"s3://{bucket}/{key}", body
        url = result.get("url") or result.get("presigned_url")
        if not url and result.get("path"):
            url = Path(str(result["path"])).absolute().as_uri()
        if url:
            url = str(url)
            local = self._check_fetch_url(url)
            try:
                if local is not None:
                    return url, local.open("rb")
                return url.split("?", 1)[0], _NO_REDIRECTS.open(url, timeout=60)
            except (urllib.error.URLError, OSError) as exc:
                raise ServiceUnavailable(f"cannot download {url.split('?', 1)[0]}: {exc}") from None
        raise ServiceUnavailable("the job result names no reachable object (no S3 credentials and no URL)")

    def _check_fetch_url(self, url: str) -> Path | None:
        """A URL from job meta (anyone with Redis access can write it) is fetched only over http(s) from the
        configured endpoint, or as a file under `local_storage_dir` (the worker's local backend on this
        machine): `file://` URLs read any local file before, any other host made the producer a proxy.
        Returns the local file for a `file://` URL, None for an http(s) one; raises FetchRefused."""
        parts = urllib.parse.urlsplit(url)
        s = self.settings
        if parts.scheme == "file" and s.local_storage_dir is not None and parts.netloc in ("", "localhost"):
            path = Path(urllib.request.url2pathname(parts.path)).resolve()
            if path.is_relative_to(Path(s.local_storage_dir).resolve()):
                return path
        allowed = {_origin(e) for e in (s.s3_public_endpoint_url, s.s3_endpoint_url) if e}
        if parts.scheme in ("http", "https") and parts.hostname and (origin := _origin(url)) is not None:
            if origin in allowed or (not allowed and parts.hostname.endswith(".amazonaws.com")):
                return None
        where = ", ".join(sorted(allowed)) or "AWS S3 (*.amazonaws.com)"
        if s.local_storage_dir is not None:
            where += f", or files under {s.local_storage_dir}"
        raise FetchRefused(
            f"refusing to fetch {url.split('?', 1)[0][:200]!r}: only http(s) from {where} "
            "(LTX_S3_PUBLIC_ENDPOINT_URL / LTX_S3_ENDPOINT_URL / LTX_LOCAL_STORAGE_DIR)"
        )


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A presigned GET never redirects; following one would leave the checked endpoint."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl[:200]} refused", headers, fp)


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def _origin(url: str) -> str | None:
    """scheme://host:port of `url`; None when its port is not a number (`http://127.0.0.1:9000.nip.io/x`:
    urllib raises ValueError reading it, which escaped as a traceback)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"
