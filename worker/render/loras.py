"""Per-request LoRAs, worker side: a request's `loras` resolved to checked local files before the fleet sees them.

`LoraResolver.resolve(refs)` turns each `LoraRef` into a file of the on-disk cache and checks it
(`ltx_mgpu.lorafile.check_lora`, header only, against the transformer the runner loads) or raises
`LoraRefused` naming the entry and what is wrong; the service fails the job as `invalid_request` (never
retried) and the fleet's weights are never touched. What the fleet gets is `[{"path", "strength"}]`.

Sources:
- `name`: `<LTX_LORA_CATALOGUE>/<name>.safetensors` (the name pattern has no separator; the resolved path
  must stay inside the catalogue, so a symlink out of it is refused);
- `uri`: `s3://bucket/key` under `LTX_LORA_S3_PREFIXES`, read with the worker's S3 client; its size comes
  from a HEAD first, so an over-limit object is refused before a byte is fetched.

The cache (`worker.render.loracache.LoraCache`) is a folder of checked files named by content, shared by the
worker's fleets; its module says how it stays consistent and durable.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltx_mgpu.lorafile import LoraFileError, LoraLimits, check_lora, transformer_targets
from worker.protocol.health import LoraOffer
from worker.protocol.lorarefs import LoraRef, split_s3_uri, uri_allowed
from worker.render.loracache import LoraCache

__all__ = ["LoraCache", "LoraRefused", "LoraResolver", "ResolvedLora"]

_SUFFIX = ".safetensors"
_CHUNK = 8 << 20


_RANGE = 64 << 20  #: bytes per ranged GET
_RANGE_THREADS = 8


def _copy_hashing(source: Path, dest: Path) -> str:
    """Copy `source` to `dest` and return its sha256, hashing each chunk while the one before is written on a
    second thread (both release the GIL): a 1.7 GB catalogue LoRA took 1.5 s against 2.6 s hashed and written
    in turn on the CPU VM. At most three chunks are in flight."""
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(dest, "wb") as dst, ThreadPoolExecutor(1) as writer:
        pending: list[Any] = []
        while chunk := src.read(_CHUNK):
            pending.append(writer.submit(dst.write, chunk))  # (one thread: the writes stay in order)
            digest.update(chunk)
            while len(pending) > 2:
                pending.pop(0).result()
        for write in pending:
            write.result()
    return digest.hexdigest()


def _ranged_download(client: Any, bucket: str, key: str, etag: str, size: int, path: Path) -> None:
    """`size` bytes of the object into `path` by parallel ranged GETs, each pinned by `IfMatch` to `etag`
    (boto3's managed download takes no IfMatch). Each range is streamed to its offset in 8 MiB pieces."""
    with open(path, "wb") as f:
        f.truncate(size)
        fd = f.fileno()

        def fetch(start: int) -> None:
            end = min(start + _RANGE, size) - 1
            body = client.get_object(Bucket=bucket, Key=key, IfMatch=etag, Range=f"bytes={start}-{end}")["Body"]
            offset = start
            while chunk := body.read(_CHUNK):
                if offset + len(chunk) > end + 1:
                    raise LoraRefused("", f"s3://{bucket}/{key}: the range {start}-{end} returned more bytes")
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
            if offset != end + 1:
                raise LoraRefused("", f"s3://{bucket}/{key}: the range {start}-{end} ended at {offset}")

        with ThreadPoolExecutor(max_workers=_RANGE_THREADS) as pool:
            for future in [pool.submit(fetch, start) for start in range(0, size, _RANGE)]:
                future.result()


class LoraRefused(ValueError):
    """A request's LoRA cannot be used; `field` names the entry (`loras[1]`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ResolvedLora:
    """One checked LoRA for the fleet, and what the job's events say about it."""

    label: str  #: the request's name or uri
    path: str  #: the cache file (checked)
    strength: float
    cached: bool  #: True if no fetch was needed
    fetch_bytes: int = 0
    fetch_s: float = 0.0  #: a miss: fetch (or catalogue copy) + check, as `ltx_worker_lora_fetch_seconds`
    verify_s: float = 0.0  #: of which header checks (every use: a hit is checked again)

    def job_kwarg(self) -> dict[str, Any]:
        return {"path": self.path, "strength": self.strength}

    def summary(self) -> dict[str, Any]:
        return {"lora": self.label, "strength": self.strength, "cached": self.cached,
                "fetch_bytes": self.fetch_bytes, "fetch_s": round(self.fetch_s, 4),
                "verify_s": round(self.verify_s, 4)}  # fmt: skip


# ==== the resolver ==========================================================================================


class LoraResolver:
    """Request LoRAs -> checked cache files; see the module docstring.

    Args:
        settings: the worker's settings (`lora_*`, `runner_setup["checkpoint_path"]`).
        s3_client: a callable returning the worker's boto3 S3 client (None: this worker has none).
        metrics: `WorkerMetrics` (cache hits/misses, fetch bytes and seconds) or None.
    """

    def __init__(self, settings: Any, *, s3_client: Callable[[], Any] | None = None, metrics: Any = None) -> None:
        self.settings = settings
        self.limits = LoraLimits(
            max_file_bytes=settings.lora_max_file_bytes,
            max_header_bytes=settings.lora_max_header_bytes,
            max_rank=settings.lora_max_rank,
        )
        self.cache = LoraCache(settings.lora_cache_dir, settings.lora_cache_bytes)
        self.catalogue = Path(settings.lora_catalogue).resolve() if settings.lora_catalogue else None
        self.prefixes = list(settings.lora_s3_prefixes)
        self._s3_client = s3_client
        self.metrics = metrics
        self.group = getattr(metrics, "group", "")
        self._targets: dict[str, tuple[int, int]] | None = None
        self._hashed: dict[tuple[str, int, int], str] = {}  #: (catalogue path, size, mtime_ns) -> sha256

    # ---- published (the producer's --dry-run checks requests against it) ----------------------------
    def published(self) -> LoraOffer:
        names = []
        if self.catalogue is not None and self.catalogue.is_dir():
            names = sorted(p.name[: -len(_SUFFIX)] for p in self.catalogue.glob(f"*{_SUFFIX}"))[:1000]
        return LoraOffer(tuple(names), tuple(self.prefixes), self.settings.lora_max_per_request)

    # ---- resolve ------------------------------------------------------------------------------------
    def resolve(self, refs: Sequence[LoraRef]) -> list[ResolvedLora]:
        """Each ref as a checked cache file, or `LoraRefused` for the first that cannot be used."""
        if len(refs) > self.settings.lora_max_per_request:
            raise LoraRefused("loras", f"{len(refs)} LoRAs; this worker takes at most "
                                       f"{self.settings.lora_max_per_request} (LTX_LORA_MAX_PER_REQUEST)")  # fmt: skip
        try:
            targets = self.targets("loras") if refs else {}
        except LoraFileError as exc:
            raise LoraRefused("loras", f"cannot read the runner's checkpoint header ({exc})") from None
        out = []
        for i, ref in enumerate(refs):
            field = f"loras[{i}]"
            try:
                out.append(self._one(ref, targets))
            except LoraFileError as exc:
                raise LoraRefused(field, f"{ref.label}: {_without_path(str(exc))}") from None
            except LoraRefused as exc:
                raise LoraRefused(field, exc.reason) from None
        return out

    def for_job(self, refs: Sequence[LoraRef], relay: Any) -> list[dict[str, Any]]:
        """`resolve` for one job: the fleet's `loras` kwarg; what was used goes into the job's summary
        (`loras`, shown by `producer status`)."""
        resolved = self.resolve(refs)
        relay.update_summary(loras=[r.summary() for r in resolved])
        return [r.job_kwarg() for r in resolved]

    def record_swap(self, output: dict[str, Any], relay: Any) -> float:
        """The seconds the fleet spent swapping LoRAs in this job (the runner's `lora_swap_*` timings), into
        the job's summary (`lora_swap_s`) and `ltx_worker_lora_swap_seconds`."""
        timings = output.get("timings_s") if isinstance(output.get("timings_s"), dict) else {}
        seconds = sum(float(v) for k, v in timings.items() if str(k).startswith("lora_swap") and v is not None)
        relay.update_summary(lora_swap_s=round(seconds, 4))
        if self.metrics is not None:
            self.metrics.lora_swap_seconds.labels(self.group).observe(seconds)
        return seconds

    def targets(self, field: str) -> dict[str, tuple[int, int]]:
        """The LoRA-able weights of the runner's transformer (read once from its checkpoint's header)."""
        if self._targets is None:
            ckpt = (self.settings.runner_setup or {}).get("checkpoint_path")
            if not ckpt:
                raise LoraRefused(field, f"runner {self.settings.runner!r} takes no LoRAs (no checkpoint_path)")
            self._targets = transformer_targets(ckpt)
        return self._targets

    def _one(self, ref: LoraRef, targets: dict[str, tuple[int, int]]) -> ResolvedLora:
        if ref.name is not None:
            return self._from_catalogue(ref, targets)
        return self._from_s3(ref, targets)

    def _from_catalogue(self, ref: LoraRef, targets: dict[str, tuple[int, int]]) -> ResolvedLora:
        if self.catalogue is None:
            raise LoraRefused("", f"{ref.label}: this worker has no LoRA catalogue (LTX_LORA_CATALOGUE)")
        source = (self.catalogue / f"{ref.name}{_SUFFIX}").resolve()
        if source.parent != self.catalogue or not source.is_file():
            raise LoraRefused("", f"{ref.label}: not in the catalogue")
        st = source.stat()
        memo = (str(source), st.st_size, st.st_mtime_ns)
        key = self._hashed.get(memo)
        if key is not None and (hit := self.cache.get(key)) is not None:
            return self._checked(ref, hit, targets, cached=True)
        t0 = time.monotonic()
        check_lora(source, targets, self.limits)  # (refuse a bad catalogue file before copying it)
        verify_s = time.monotonic() - t0
        with self.cache.incoming() as tmp:
            key = f"sha256-{_copy_hashing(source, tmp)}"
            self._hashed[memo] = key
            if (hit := self.cache.get(key)) is not None:
                return self._checked(ref, hit, targets, cached=True)
            verify_s += _timed(check_lora, tmp, targets, self.limits)
            path = self.cache.commit(tmp, key)
        return self._fetched(ref, path, st.st_size, time.monotonic() - t0, verify_s)

    def _from_s3(self, ref: LoraRef, targets: dict[str, tuple[int, int]]) -> ResolvedLora:
        uri = str(ref.uri)
        if not uri_allowed(uri, self.prefixes):
            raise LoraRefused("", f"{uri}: under no prefix this worker allows (LTX_LORA_S3_PREFIXES)")
        client = self._s3_client() if self._s3_client is not None else None
        if client is None:
            raise LoraRefused("", f"{uri}: this worker has no S3 client (storage_backend is not s3)")
        bucket, key = split_s3_uri(uri)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise LoraRefused("", f"{uri}: no such object ({code})" if code in ("404", "NoSuchKey", "NotFound")
                              else f"{uri}: cannot read it ({code or exc})") from None  # fmt: skip
        except BotoCoreError as exc:
            raise LoraRefused("", f"{uri}: cannot read it ({exc})") from None
        size = int(head.get("ContentLength", 0))
        if size > self.limits.max_file_bytes:
            raise LoraRefused("", f"{uri}: object is {size} bytes, over the {self.limits.max_file_bytes} byte limit")
        etag = str(head.get("ETag", "")).strip('"')
        cache_key = "s3-" + hashlib.sha256(f"{bucket}/{key}\0{etag}\0{size}".encode()).hexdigest()
        if (hit := self.cache.get(cache_key)) is not None:
            return self._checked(ref, hit, targets, cached=True)
        t0 = time.monotonic()
        with self.cache.incoming() as tmp:
            try:
                # ranged GETs in parallel (a rank-128 LoRA at real size is 1.7 GB); IfMatch pins every range
                # to the object the HEAD sized, so a replaced object fails the fetch instead of mixing bytes
                _ranged_download(client, bucket, key, head.get("ETag", "*"), size, tmp)
            except (ClientError, BotoCoreError) as exc:
                raise LoraRefused("", f"{uri}: fetch failed ({exc})") from None
            verify_s = _timed(check_lora, tmp, targets, self.limits)
            path = self.cache.commit(tmp, cache_key)
        return self._fetched(ref, path, size, time.monotonic() - t0, verify_s)

    def _checked(self, ref: LoraRef, path: Path, targets: dict, *, cached: bool) -> ResolvedLora:
        verify_s = _timed(check_lora, path, targets, self.limits)  # header only: cheap, guards the cache folder too
        if self.metrics is not None:
            self.metrics.lora_cache.labels(self.group, "hit").inc()
        return ResolvedLora(ref.label, str(path), ref.strength, cached=cached, verify_s=verify_s)

    def _fetched(self, ref: LoraRef, path: Path, size: int, seconds: float, verify_s: float) -> ResolvedLora:
        if self.metrics is not None:
            self.metrics.lora_cache.labels(self.group, "miss").inc()
            self.metrics.lora_fetch_bytes.labels(self.group).inc(size)
            self.metrics.lora_fetch_seconds.labels(self.group).observe(seconds)
        return ResolvedLora(
            ref.label, str(path), ref.strength, cached=False, fetch_bytes=size, fetch_s=seconds, verify_s=verify_s
        )


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds `fn(*args)` took (it raises through)."""
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


def _without_path(message: str) -> str:
    """`check_lora` names the file it read; a client needs what is wrong, not the worker's cache path."""
    head, sep, tail = message.partition(": ")
    return tail if sep and (os.sep in head or head.endswith(_SUFFIX)) else message
