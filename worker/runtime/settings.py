"""Worker settings: environment variables (prefix `LTX_`), an optional settings file, CLI overrides.

Precedence, highest first: CLI flags → environment → settings file (`LTX_SETTINGS_FILE` or `--settings`;
`.json`, `.toml`, `.yaml`/`.yml`) → defaults. Invalid values fail at start with `SettingsError`, whose
message names the field and its environment variable, so a typo in a deployment never reaches a job.

Runners are chosen by *name* from the `runners` registry (`name → "module:Class"`); the class is imported
only when a worker process builds its fleet, so settings (and the supervisor) never import torch.
Credentials come from the environment or from files (`*_FILE`), never from requests, and are never
logged (they are `SecretStr`; `public_dump()` masks them).

Over 450 lines on purpose: one settings class whose fields and validators are the worker's whole
configuration surface; the docs-sync test reads it as one table, and splitting it would scatter that.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from ltx_mgpu.control.devices import canonical_group
from worker.protocol.keys import check_tenant_name
from worker.protocol.redisconn import ServiceAccess
from worker.protocol.sharedsettings import S3_SECRET_FILE_FIELDS, read_secret_file, safe_redis_url, split_list

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

ENV_PREFIX = "LTX_"
SETTINGS_FILE_ENV = "LTX_SETTINGS_FILE"

#: Runners every worker knows. Import paths, so nothing is imported until a fleet is built.
BUILTIN_RUNNERS: dict[str, str] = {
    "smoke": "ltx_mgpu.runners.smoke:SmokeRunner",
    "noop": "worker.render.noop:NoopRunner",
    "ltx2-distilled": "ltx_mgpu.runners.ltx2.runners:Ltx2DistilledRunner",
    "ltx2-two-stage": "ltx_mgpu.runners.ltx2.runners:Ltx2TwoStageRunner",
}

_MiB = 1024 * 1024


_PRESIGN_FILE_FIELDS = (
    ("s3_presign_access_key_id", "s3_presign_access_key_id_file"),
    ("s3_presign_secret_access_key", "s3_presign_secret_access_key_file"),
)


class SettingsError(ValueError):
    """Settings are invalid; the message names each offending field and its environment variable."""


def validate_group(spec: str) -> str:
    """Check a device group spec and return its canonical spelling ("cpu", "cpu:2", "0,1,2,3").

    The engine's own parser (`ltx_mgpu.control.devices`, torch-free), so what passes here is what the fleet runs on.
    """
    return canonical_group(spec)


def group_label(spec: str) -> str:
    """A name-safe label for a group ("0,1,2,3" → "g0-1-2-3", "cpu:2" → "cpu2")."""
    text = validate_group(spec)
    if text.startswith("cpu"):
        return "cpu" + (text.split(":")[1] if ":" in text else "1")
    return "g" + text.replace(",", "-")


class WorkerSettings(ServiceAccess, BaseSettings):
    """Every knob of a worker process. Field `x` is environment variable `LTX_X` (case-insensitive); the
    `redis_*` credential and TLS fields, and the checks of `redis_url` and `queues`, come from
    `worker.protocol.redisconn.ServiceAccess`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
        hide_input_in_errors=True,  # a validation error must never print the Redis or S3 secrets
    )

    # ---- Redis / RQ ---------------------------------------------------------------------------------
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for queues, job state and events")
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["ltx-render"],
        description="queues to take jobs from, highest priority first (comma-separated or a JSON list)",
    )
    worker_name: str | None = Field(
        None, description="RQ worker name prefix (default: host name); the group and pid are appended"
    )
    result_ttl: int = Field(86400, ge=-1, description="seconds a finished job, its result and events stay")
    failure_ttl: int = Field(7 * 86400, ge=1, description="seconds a failed job stays (RQ's default: 1 year)")
    events_maxlen: int = Field(1000, ge=10, description="approximate cap of entries per job event stream")
    heartbeat_interval: float = Field(10.0, gt=0, description="seconds between heartbeats while a job runs")
    job_heartbeat_ttl: int = Field(
        60, ge=5, description="seconds without a heartbeat after which a running job counts as abandoned"
    )
    worker_ttl: int = Field(60, ge=20, description="seconds an idle worker's registration lives between beats")
    tenant_ids: bool = Field(
        False,
        description="job ids are '<client>-<id>' (tenant Redis users, `ltx-worker redis-acl`): a job whose meta "
        "client is not its id's prefix is refused as invalid_request",
    )
    tenants: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="tenants (the `--tenant`s of `ltx-worker redis-acl`) whose own queues '<queue>:t:<tenant>' "
        "this worker serves next to the shared queues, in turn; needs tenant_ids (comma-separated or JSON)",
    )
    tenant_redis_bytes: int = Field(
        0,
        ge=-1,
        description="Redis memory each tenant's keys may hold before workers delete them, largest and "
        "ended first (worker.jobs.tenantmemory); 0: half of Redis's maxmemory shared among the tenants; -1: off",
    )
    max_request_bytes: int = Field(
        1 << 20, ge=4096, description="largest job data (the request) decompressed; a bigger job is refused"
    )
    max_meta_bytes: int = Field(
        64 << 10, ge=4096, description="largest job meta (the producer's summary and extra meta); bigger is refused"
    )
    maintenance_interval: int = Field(
        60, ge=1, description="seconds between RQ registry cleanups (abandoned-job detection latency)"
    )

    # ---- admission (the producer's caps, held by the worker too: worker.jobs.admission) -------------------
    max_queue_depth: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="jobs that may wait in `queues` together; the newest beyond are ended as queue_full "
        "without running (unset or 0: no cap; the producer reads the same variable)",
    )
    client_quota: int | None = Field(
        None,
        ge=0,
        le=100_000,
        description="unfinished jobs of one client (meta `client`; none: anonymous); a job with this many of "
        "its client's ahead of it is ended as quota_exceeded (unset or 0: none; the producer reads it too)",
    )

    # ---- fleets --------------------------------------------------------------------------------------
    groups: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["cpu:1"],
        description="device groups, one worker process each: 'cpu:2', '0,1,2,3' (';'-separated or JSON)",
    )
    runner: str = Field("smoke", description="name of the runner (a key of `runners`)")
    runners: dict[str, str] = Field(
        default_factory=dict, description="extra runners: name → 'module:Class' (merged over the built-ins)"
    )
    runner_setup: dict[str, Any] = Field(default_factory=dict, description="kwargs for the runner's setup()")
    fleet_start_timeout: float = Field(1800.0, gt=0, description="seconds for a fleet to start (model load)")
    warmup_requests: list[dict[str, Any]] = Field(
        default_factory=list,
        description="requests (RenderRequest JSON) rendered once after every fleet start, before the first job "
        "(compilation, allocator growth, caches for these sizes); their time is the warm-up of cold start",
    )
    device_memory_gib: float | None = Field(
        None, gt=0, description="GiB each device offers the fleet's memory plan (ltx_mgpu.memplan); unset: measured "
        "after the warm-up on GPU fleets, no limit on CPU fleets"
    )  # fmt: skip
    memory_headroom_gib: float = Field(
        4.0, ge=0, description="GiB the memory plan keeps free on every device beyond its predicted peak"
    )
    render_timeout: float = Field(3600.0, gt=0, description="seconds one render may take in the fleet")
    fleet_shutdown_timeout: float = Field(30.0, ge=0, description="graceful seconds when stopping a fleet")
    fleet_error_settle_s: float = Field(
        30.0, gt=0, description="once some ranks ended a job with an error, seconds the others get to end it too "
        "before the fleet is taken to be stuck in a collective and rebuilt"
    )  # fmt: skip
    deterministic: Literal["auto", "on", "off", "strict"] = Field(
        "auto", description="deterministic renders (same request, seed, layout and software: the same frames and "
        "audio; ltx_mgpu.control.determinism): on, strict (torch refuses every nondeterministic op, cuDNN's "
        "attention included), off; auto = on for CPU fleets, off for GPU fleets"
    )  # fmt: skip
    max_rebuild_failures: int = Field(
        3, ge=1, description="consecutive failed fleet (re)builds after which the worker exits non-zero"
    )
    rebuild_backoff_s: float = Field(2.0, ge=0, description="first back-off between failed rebuilds (doubles)")
    restart_backoff_s: float = Field(
        1.0, ge=0, description="supervisor: first wait before restarting a worker that exited before it was ever "
        "ready (doubles per such exit in a row); a worker that was ready is restarted after this"
    )  # fmt: skip
    restart_backoff_max_s: float = Field(60.0, ge=0, description="supervisor: the cap of that back-off")
    restart_alarm_after: int = Field(
        3, ge=1, description="supervisor: never-ready exits in a row from which it logs critical, sets "
        "ltx_supervisor_crash_loop and answers /readyz 503"
    )  # fmt: skip

    # ---- retry policy (the worker decides per failure reason; RQ Retry objects are overridden) ------
    retry_fleet_failure: int = Field(1, ge=0, description="re-queues after a fleet failure")
    retry_worker_lost: int = Field(1, ge=0, description="re-queues after the worker vanished mid-job")
    retry_worker_shutdown: int = Field(1, ge=0, description="re-queues after a cold stop mid-job")
    retry_upload_failed: int = Field(1, ge=0, description="re-queues after all upload attempts failed")
    retry_job_timeout: int = Field(0, ge=0, description="re-queues after RQ's job_timeout fired")
    retry_spool_error: int = Field(1, ge=0, description="re-queues after the spool could not hold the render")
    max_attempts: int = Field(
        5, ge=1, description="hard cap on executions of one job, whatever the reasons (bounds every retry path)"
    )

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
        None, description="sign result URLs with this read-only key (unset: the worker's key, whose id then "
        "appears in every URL stored in Redis)"
    )  # fmt: skip
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
    upload_multipart_threshold: int = Field(16 * _MiB, ge=5 * _MiB)
    upload_multipart_chunksize: int = Field(16 * _MiB, ge=5 * _MiB)
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
        20 * 1024 * _MiB, ge=_MiB, description="bytes waiting for upload before the worker stops taking jobs"
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

    # ---- per-request LoRAs (worker.render.loras) ------------------------------------------------------------
    lora_catalogue: Path | None = Field(
        None, description="folder of <name>.safetensors a request may name (`loras[].name`); unset: none"
    )
    lora_s3_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="`bucket/prefix` entries a request's `loras[].uri` must fall under"
    )
    lora_shared_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="`bucket/prefix` entries every tenant may read LoRAs from; with tenants (tenant_ids) a "
        "`loras[].uri` must be under one of these or under `<lora_s3_prefixes entry>/<tenant>/`",
    )
    lora_max_per_request: int = Field(4, ge=0, le=8, description="LoRAs one request may ask for (0: none)")
    lora_max_file_bytes: int = Field(4 * 1024 * _MiB, ge=1, description="largest LoRA file fetched or fused")
    lora_max_header_bytes: int = Field(16 * _MiB, ge=1024, description="largest safetensors header read")
    lora_max_rank: int = Field(256, ge=1, description="highest LoRA rank fused")
    lora_cache_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "ltx-lora-cache",
        description="checked LoRA files, by content; shared by the worker's fleets",
    )
    lora_cache_bytes: int = Field(
        16 * 1024 * _MiB,
        ge=_MiB,
        description="size cap of lora_cache_dir (LRU), held at all times: a job's LoRAs must fit it together",
    )

    @field_validator("lora_s3_prefixes", "lora_shared_prefixes", mode="before")
    @classmethod
    def _parse_lora_prefixes(cls, value: Any) -> Any:
        return split_list(value, ",")

    def lora_limits(self) -> tuple[int, int, int]:
        """(LoRAs per request, file bytes, rank): what a request's LoRAs may hold on a fleet (the memory plan)."""
        return self.lora_max_per_request, self.lora_max_file_bytes, self.lora_max_rank

    # ---- observability -------------------------------------------------------------------------------
    metrics_port: int | None = Field(
        9400,
        ge=0,
        le=65535,
        description="Prometheus /metrics and /healthz port of group 0 (group i: +i); 0 = any free port, unset = off",
    )
    supervisor_port: int | None = Field(
        None, ge=0, le=65535, description="the supervisor's /metrics, /healthz and /readyz (every group's worker "
        "ready, else why not); 0 = any free port, unset = off"
    )  # fmt: skip
    metrics_host: str = Field(
        "127.0.0.1", description="address /metrics and /healthz listen on (loopback; compose sets 0.0.0.0)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"

    # ---- sources -------------------------------------------------------------------------------------
    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(SETTINGS_FILE_ENV)
        if path:
            sources.append(_file_source(settings_cls, Path(path)))
        return tuple(sources)

    # ---- validation ----------------------------------------------------------------------------------
    @field_validator("groups", mode="before")
    @classmethod
    def _parse_groups(cls, value: Any) -> Any:
        return split_list(value, ";")

    @field_validator("max_queue_depth", "client_quota", mode="before")
    @classmethod
    def _limit_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none"):
            return None
        return value

    @field_validator("metrics_port", "supervisor_port", mode="before")
    @classmethod
    def _metrics_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none", "false"):
            return None
        return value

    @field_validator("tenants", mode="before")
    @classmethod
    def _parse_tenants(cls, value: Any) -> Any:
        return split_list(value, ",")

    @field_validator("tenants")
    @classmethod
    def _check_tenants(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(check_tenant_name(t) for t in value))

    @field_validator("groups")
    @classmethod
    def _check_groups(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one device group is needed")
        groups = [validate_group(g) for g in value]
        gpus = [int(i) for g in groups if not g.startswith("cpu") for i in g.split(",")]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"groups {groups} share a GPU; groups must be disjoint")
        return groups

    @field_validator("warmup_requests")
    @classmethod
    def _check_warmup(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from worker.protocol.schema import RenderRequest

        for i, request in enumerate(value):
            try:
                RenderRequest.model_validate(request)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err.get("loc", ())) or "(request)"
                raise ValueError(f"request {i}: field {where!r}: {err.get('msg')}") from None
        return value

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

    @field_validator("runners")
    @classmethod
    def _check_runner_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not re.fullmatch(r"[\w.]+:[\w.]+", path):
                raise ValueError(f"runner {name!r}: {path!r} is not 'module:Class'")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> WorkerSettings:
        if self.runner not in self.runner_registry:
            raise ValueError(
                f"runner ({ENV_PREFIX}RUNNER): {self.runner!r} is not registered; "
                f"known: {sorted(self.runner_registry)} (add one with {ENV_PREFIX}RUNNERS)"
            )
        if self.storage_backend == "local" and self.local_storage_dir is None:
            raise ValueError(
                f"local_storage_dir ({ENV_PREFIX}LOCAL_STORAGE_DIR) is required when storage_backend='local'"
            )
        for secret, file_field in (*S3_SECRET_FILE_FIELDS, *_PRESIGN_FILE_FIELDS):
            path = getattr(self, file_field)
            if path is not None:
                object.__setattr__(self, secret, SecretStr(read_secret_file(path, file_field)))
        for key_id, secret in (("s3_access_key_id", "s3_secret_access_key"),
                               ("s3_presign_access_key_id", "s3_presign_secret_access_key")):  # fmt: skip
            if (getattr(self, key_id) is None) != (getattr(self, secret) is None):
                raise ValueError(f"{key_id} / {secret} ({ENV_PREFIX}{key_id.upper()}, {ENV_PREFIX}{secret.upper()}): "
                                 "set both or neither")  # fmt: skip
        if self.tenants and not self.tenant_ids:
            raise ValueError(f"tenants ({ENV_PREFIX}TENANTS) need tenant_ids ({ENV_PREFIX}TENANT_IDS=true): a "
                             "tenant queue holds only ids with its tenant's prefix")  # fmt: skip
        if self.job_heartbeat_ttl < 3 * self.heartbeat_interval:
            # a running job is declared abandoned after this; two missed beats must never be enough
            raise ValueError(
                f"job_heartbeat_ttl ({ENV_PREFIX}JOB_HEARTBEAT_TTL) must be at least three times "
                f"heartbeat_interval ({ENV_PREFIX}HEARTBEAT_INTERVAL)"
            )
        return self

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def runner_registry(self) -> dict[str, str]:
        return {**BUILTIN_RUNNERS, **self.runners}

    @property
    def depth_cap(self) -> int | None:
        """`max_queue_depth`, None when off (0 means off, as for the producer)."""
        return self.max_queue_depth or None

    @property
    def quota(self) -> int | None:
        """`client_quota`, None when off (0 means off, as for the producer)."""
        return self.client_quota or None

    @property
    def checksum_when_required(self) -> bool:
        if self.s3_checksum_when_required is not None:
            return self.s3_checksum_when_required
        return self.s3_endpoint_url is not None

    def worker_name_for(self, group: str) -> str:
        """A unique RQ worker name: <prefix>.<group label>.<pid>."""
        prefix = self.worker_name or socket.gethostname()
        return f"{prefix}.{group_label(group)}.{os.getpid()}"

    def warmup_jobs(self) -> list[dict[str, Any]]:
        """The warm-up requests as runner job kwargs (unset fields left to the runner, like real jobs)."""
        from worker.protocol.schema import RenderRequest

        return [RenderRequest.model_validate(r).runner_kwargs() for r in self.warmup_requests]

    def metrics_port_for(self, index: int) -> int | None:
        if self.metrics_port is None:
            return None
        return 0 if self.metrics_port == 0 else self.metrics_port + index

    def public_dump(self) -> dict[str, Any]:
        """JSON-safe settings with secrets masked (for logs and `ltx-worker settings`)."""
        data = self.model_dump(mode="json")
        for key in ("s3_access_key_id", "s3_secret_access_key", "s3_presign_access_key_id",
                    "s3_presign_secret_access_key", "redis_password"):  # fmt: skip
            if data.get(key) is not None:
                data[key] = "**********"
        data["redis_url"] = safe_redis_url(self.redis_url)  # (its password)
        return data


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    suffix = path.suffix.lower()
    if not path.exists():
        raise SettingsError(f"settings file {path} ({SETTINGS_FILE_ENV}) does not exist")
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise SettingsError(f"settings file {path}: use .json, .toml or .yaml")


def load_settings(settings_file: str | Path | None = None, **overrides: Any) -> WorkerSettings:
    """Build settings from CLI overrides, the environment and the settings file; raise `SettingsError`.

    `settings_file` (e.g. from `--settings`) takes the place of `LTX_SETTINGS_FILE` for this call.
    """
    previous = os.environ.get(SETTINGS_FILE_ENV)
    if settings_file is not None:
        os.environ[SETTINGS_FILE_ENV] = str(settings_file)
    try:
        return WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(_format_errors(exc)) from None
    finally:
        if settings_file is not None:
            if previous is None:
                os.environ.pop(SETTINGS_FILE_ENV, None)
            else:
                os.environ[SETTINGS_FILE_ENV] = previous


def _format_errors(exc: ValidationError) -> str:
    lines = ["invalid worker settings:"]
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if not loc:  # a cross-field check: its message names the fields itself
            lines.append(f"  - {msg}")
            continue
        field, detail = loc[0], ".".join(loc[1:])
        where = f"{field} ({ENV_PREFIX}{field.upper()})"
        lines.append(f"  - {where}{'[' + detail + ']' if detail else ''}: {msg}")
    return "\n".join(lines)


def resolve_runner(settings: WorkerSettings) -> type:
    """Import the configured runner class (in the worker process only: this may import torch)."""
    path = settings.runner_registry[settings.runner]
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"runner ({ENV_PREFIX}RUNNER) {settings.runner!r}: cannot import {path}: {exc}") from exc
    if not isinstance(obj, type):
        raise SettingsError(f"runner {settings.runner!r}: {path} is not a class")
    return obj
