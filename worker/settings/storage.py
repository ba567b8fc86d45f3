"""Where videos go: storage, the spool, uploads and the worker's encoder (fields of `WorkerSettings`).

Credentials come from the environment or from files (`*_FILE`, read by `WorkerSettings`'s cross-field check),
never from requests, and are never logged (they are `SecretStr`).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator

from worker.settings.base import MIB

__all__ = ["PRESIGN_FILE_FIELDS", "StorageFields"]

#: (secret field, the field naming the file it is read from) of the presign key.
PRESIGN_FILE_FIELDS = (
    ("s3_presign_access_key_id", "s3_presign_access_key_id_file"),
    ("s3_presign_secret_access_key", "s3_presign_secret_access_key_file"),
)


class StorageFields(BaseModel):
    """Storage, spool, upload and encoder fields."""

    # ---- storage -------------------------------------------------------------------------------------
    storage_backend: Literal["s3", "local"] = Field("s3", description="where finished videos go")
    s3_endpoint_url: str | None = Field(None, description="S3 API endpoint (unset: AWS)")
    s3_public_endpoint_url: str | None = Field(
        None, description="endpoint clients use; presigned URLs are signed for it (default: s3_endpoint_url)"
    )
    s3_bucket: str = Field("ltx-videos", min_length=3, max_length=63)
    s3_prefix: str = Field("videos/", description="key prefix; objects are <prefix><job_id>/<output_name>")
    s3_region: str = Field("us-east-1")
    s3_addressing_style: Literal["path", "virtual", "auto"] = Field("path")
    s3_access_key_id: SecretStr | None = Field(None, description="unset: boto3's default credential chain")
    s3_secret_access_key: SecretStr | None = None
    s3_access_key_id_file: Path | None = Field(None, description="read the access key id from this file")
    s3_secret_access_key_file: Path | None = Field(None, description="read the secret key from this file")
    s3_presign_access_key_id: SecretStr | None = Field(
        None,
        description="sign result URLs with this read-only key (unset: the worker's key, whose id then "
        "appears in every URL stored in Redis)",
    )
    s3_presign_secret_access_key: SecretStr | None = None
    s3_presign_access_key_id_file: Path | None = Field(None, description="read the presign key id from this file")
    s3_presign_secret_access_key_file: Path | None = Field(None, description="read the presign secret from this file")
    s3_checksum_when_required: bool | None = Field(
        None, description="send CRC checksums only when required (default: on for custom endpoints)"
    )
    s3_create_bucket: bool = Field(False, description="create the bucket at start if it does not exist")
    s3_connect_timeout: float = Field(5.0, gt=0)
    s3_read_timeout: float = Field(60.0, gt=0)
    local_storage_dir: Path | None = Field(None, description="root directory for storage_backend=local")
    output_name: str = Field("video.mp4", description="file name of the video in the spool and storage")
    upload_multipart_threshold: int = Field(16 * MIB, ge=5 * MIB)
    upload_multipart_chunksize: int = Field(16 * MIB, ge=5 * MIB)
    upload_max_concurrency: int = Field(8, ge=1)
    upload_attempts: int = Field(5, ge=1, description="attempts per upload before the job fails")
    upload_backoff_s: float = Field(1.0, ge=0, description="first back-off between attempts (doubles)")
    upload_backoff_max_s: float = Field(30.0, ge=0)
    presign_expiry_s: int = Field(7 * 86400, ge=1, le=7 * 86400, description="presigned URL lifetime (max 7 d)")
    spool_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "ltx-spool",
        description="local directory where renders wait until their upload is confirmed",
    )
    spool_min_free_bytes: int = Field(
        1 << 30,
        ge=0,
        description="free bytes the spool's disk must keep; below, the worker takes no job (back-pressure)",
    )
    spool_min_free_inodes: int = Field(
        16,
        ge=0,
        description="free inodes the spool's disk must keep (a job writes a folder, its video, a manifest and a "
        "lock); below, the worker takes no job (back-pressure); the LoRA cache keeps them too",
    )
    upload_pipeline: bool = Field(
        True,
        description="upload in a background thread so the fleet takes the next job at once (false: the "
        "job function uploads before it returns)",
    )
    upload_threads: int = Field(2, ge=1, le=32, description="background uploads in flight at once")
    max_pending_uploads: int = Field(
        8, ge=1, description="renders waiting for (or in) upload before the worker stops taking jobs"
    )
    max_pending_bytes: int = Field(
        20 * 1024 * MIB, ge=MIB, description="bytes waiting for upload before the worker stops taking jobs"
    )
    encode_in_worker: bool = Field(
        True,
        description="the fleet hands yuv420p frames and audio off and the worker encodes the mp4 beside the next "
        "job (false: the fleet's driver rank encodes before it is free)",
    )
    encode_stream: bool = Field(
        True,
        description="with encode_in_worker, the fleet hands frames off while its VAE decodes and the x264 runs "
        "start on the first decoded frames (runners listing 'stream' in media_modes; false: one hand-off after "
        "the decode)",
    )
    encode_crf: int = Field(18, ge=0, le=51, description="H.264 quality of the mp4 (x264 crf; 0 = lossless)")
    encode_preset: Literal[
        "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo"
    ] = Field("veryfast", description="x264 preset (speed against size): ultrafast ... placebo")
    encode_tune: Literal["", "film", "animation", "grain", "stillimage", "psnr", "ssim", "fastdecode"] = Field(
        "fastdecode", description="x264 tune ('' = none); fastdecode: CAVLC, no deblocking (half the CPU on noise)"
    )
    encode_bframes: int = Field(0, ge=-1, le=16, description="x264 B-frames; -1 = the preset's (3 at veryfast)")
    encode_threads: int = Field(0, ge=0, le=256, description="cores the x264 encode uses; 0 = every core of the host")
    encode_segments: int = Field(
        0,
        ge=0,
        le=256,
        description="parallel x264 runs per video joined by the muxer; 0 = one per thread "
        "(runs of >= 16 frames), 1 = one x264 with frame threads",
    )
    max_pending_encodes: int = Field(
        2, ge=1, le=64, description="videos waiting for (or in) the worker's encoder before it stops taking jobs"
    )
    upload_drain_timeout_s: float = Field(
        600.0, ge=0, description="seconds a warm stop waits for pending uploads before leaving them in the spool"
    )

    @field_validator("s3_endpoint_url", "s3_public_endpoint_url")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/") if value else value

    @field_validator("s3_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        value = value.lstrip("/")
        return value if not value or value.endswith("/") else value + "/"

    @field_validator("output_name")
    @classmethod
    def _check_output_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value) or value.startswith("."):
            raise ValueError("must be a plain file name (letters, digits, _.-)")
        return value

    @property
    def checksum_when_required(self) -> bool:
        if self.s3_checksum_when_required is not None:
            return self.s3_checksum_when_required
        return self.s3_endpoint_url is not None
