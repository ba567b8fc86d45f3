"""Per-request LoRAs, worker side: a request's `loras` resolved to checked local files before the fleet sees them.

`LoraResolver.resolve(refs)` turns each `LoraRef` into a file of the on-disk cache and checks it
(`ltx_mgpu.lora_file.check_lora`, header only, against the transformer the runner loads) or raises
`LoraRefused` naming the entry and what is wrong; the service fails the job as `invalid_request` (never
retried) and the fleet's weights are never touched. What the fleet gets is `[{"path", "strength"}]`.

Sources:
- `name`: `<LTX_LORA_CATALOGUE>/<name>.safetensors` (the name pattern has no separator; the resolved path
  must stay inside the catalogue, so a symlink out of it is refused);
- `uri`: `s3://bucket/key` under `LTX_LORA_S3_PREFIXES` (with tenants, under the job's tenant's folder there
  or a shared prefix: `ltx_contract.lora_refs.uri_problem`), read with the worker's S3 client. Its size
  comes from a HEAD, so an over-limit object is refused before a byte is fetched, and its header from a
  ranged GET of its first bytes, checked before the body is fetched.

Refusals that need no download come before any download (each a `LoraRefused`, `invalid_request`): the
count, a runner that takes no request LoRAs as it is set up (`takes_loras`: it would only fail the job
after the fetches), the sizes of a job's distinct LoRAs over its share of the cache (`lora_too_large`: the
cache's caps over the worker processes sharing it, `LoraCache.share`, so one job never takes the room
another group's job needs), and the strengths of one file (by content: an S3 object's ETag and size, a
catalogue file's sha256 once known) in sum (`ltx_contract.lora_refs.strength_problem`).

The cache (`worker.render.lora_cache.LoraCache`) is a folder of checked files named by content and, with
tenants, by tenant (S3 objects and catalogue files alike: one tenant's `cached`, `fetch_bytes` or `fetch_s`
never tells whether another used a LoRA), shared by the worker's fleets; its module says how its caps hold
and how files in use stay pinned. A fetch the cache cannot make room for now raises `LoraCacheFull` (the
service re-queues the job to wait for room); any other failed write (a full disk) raises `OSError`: the
service fails the job as `spool_error`, never `internal`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltx_contract.health import LoraOffer
from ltx_contract.lora_refs import LoraRef, split_s3_uri, strength_problem, uri_problem
from ltx_mgpu.lora_file import (
    LoraFileError,
    LoraLimits,
    check_lora,
    transformer_targets,
)
from worker.render.lora_cache import LoraCache, LoraCacheFull
from worker.render.lora_fetch import LoraRefused, check_remote_header, copy_hashing, ranged_download

__all__ = ["LoraCache", "LoraCacheFull", "LoraRefused", "LoraResolver", "ResolvedLora", "runner_takes_loras"]

_SUFFIX = ".safetensors"
#: how long one fetch waits in place for cache room (others' jobs ending, uploads freeing the disk) before the
#: job is re-queued to wait (`worker.jobs.ends.Failure.no_room`): the pause between its tries
ROOM_WAIT_S = 5.0


@dataclass(frozen=True)
class _Plan:
    """One ref before its fetch: `ident` names its bytes (a job's distinct LoRAs are summed by it)."""

    ref: LoraRef
    ident: str  #: S3: the cache key; catalogue: "file:<path>"
    size: int
    content: str  #: what its bytes are, as far as known before a fetch (strengths are summed by it)
    owner: str = ""  #: the job's tenant where the cache keys files by tenant
    source: Path | None = None  #: catalogue
    memo: tuple[str, int, int] | None = None  #: catalogue: (path, size, mtime_ns)
    client: Any = None  #: S3
    bucket: str = ""
    key: str = ""
    etag: str = "*"


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
    content: str = ""  #: what its bytes are (sha256, or an S3 ETag and size: copies under other keys match)

    def job_kwarg(self) -> dict[str, Any]:
        return {"path": self.path, "strength": self.strength}

    def summary(self) -> dict[str, Any]:
        return {
            "lora": self.label,
            "strength": self.strength,
            "cached": self.cached,
            "fetch_bytes": self.fetch_bytes,
            "fetch_s": round(self.fetch_s, 4),
            "verify_s": round(self.verify_s, 4),
        }


# ==== the resolver ==========================================================================================


class LoraResolver:
    """Request LoRAs -> checked cache files; see the module docstring.

    Args:
        settings: the worker's settings (`lora_*`, `runner_setup["checkpoint_path"]`).
        s3_client: a callable returning the worker's boto3 S3 client (None: this worker has none).
        metrics: `WorkerMetrics` (cache hits/misses, fetch bytes and seconds) or None.
    """

    def __init__(
        self,
        settings: Any,
        *,
        s3_client: Callable[[], Any] | None = None,
        metrics: Any = None,
        takes_loras: bool = True,
    ) -> None:
        self.settings = settings
        self.takes_loras = takes_loras  #: the runner fuses request LoRAs as it is set up
        self.limits = LoraLimits(
            max_file_bytes=settings.lora_max_file_bytes,
            max_header_bytes=settings.lora_max_header_bytes,
            max_rank=settings.lora_max_rank,
        )
        self.cache = LoraCache(
            settings.lora_cache_dir,
            settings.lora_cache_bytes,
            cap_files=settings.lora_cache_files,
            min_free_bytes=settings.spool_min_free_bytes,
            min_free_inodes=settings.spool_min_free_inodes,
        )
        self.catalogue = Path(settings.lora_catalogue).resolve() if settings.lora_catalogue else None
        self.prefixes = list(settings.lora_s3_prefixes)
        self.shared = list(getattr(settings, "lora_shared_prefixes", []) or [])
        self.per_tenant = bool(getattr(settings, "tenant_ids", False))
        self._s3_client = s3_client
        self.metrics = metrics
        self.group = getattr(metrics, "group", "")
        self._targets: dict[str, tuple[int, int]] | None = None
        self._hashed: dict[tuple[str, int, int], str] = {}  #: (catalogue path, size, mtime_ns) -> sha256

    @classmethod
    def for_worker(cls, settings: Any, runner_cls: Any, storage: Any, metrics: Any) -> LoraResolver:
        """A worker process's resolver: its storage's S3 client (None: not S3), whether its runner fuses request
        LoRAs as set up (`runner_takes_loras`), and, where it serves them, its share of the cache from the
        start (`LoraCache.join`)."""
        fuses = runner_takes_loras(runner_cls, settings.runner_setup)
        resolver = cls(settings, s3_client=lambda: getattr(storage, "client", None), metrics=metrics, takes_loras=fuses)
        if fuses and (settings.lora_catalogue or settings.lora_s3_prefixes):
            resolver.cache.join()
        return resolver

    # ---- published (the producer's --dry-run checks requests against it) ----------------------------
    def published(self) -> LoraOffer:
        names = []
        if self.catalogue is not None and self.catalogue.is_dir():
            names = sorted(
                p.name[: -len(_SUFFIX)] for p in self.catalogue.glob(f"*{_SUFFIX}") if self._in_catalogue(p) is not None
            )[:1000]
        most = self.settings.lora_max_per_request if self.takes_loras else 0  # (refused at submit, then)
        return LoraOffer(tuple(names), tuple(self.prefixes), most, tuple(self.shared), self.per_tenant)

    def _in_catalogue(self, path: Path) -> Path | None:
        """`path` resolved, if it is a file inside the catalogue (a symlink out of it is not)."""
        source = path.resolve()
        return source if source.parent == self.catalogue and source.is_file() else None

    # ---- resolve ------------------------------------------------------------------------------------
    def resolve(self, refs: Sequence[LoraRef], tenant: str | None = None) -> list[ResolvedLora]:
        """Each ref as a checked, pinned cache file, or `LoraRefused` for the first that cannot be used.
        `tenant`: the job's tenant (with `tenant_ids`), whose S3 folder its uris must be in. The previous
        job's pins are released first. Every refusal that needs no download comes before the first fetch
        (module docstring). `LoraCacheFull`: no room in the cache now; `OSError`: the cache's disk failed."""
        self.cache.release()
        targets = self._refuse_early(refs)
        plans = [self._field(i, ref, self._plan, ref, tenant) for i, ref in enumerate(refs)]
        self._refuse_plans(plans)
        # every hit pinned and every miss's header checked (a catalogue file's, an object's by one ranged GET)
        # before the first body is fetched: a job refused for its second LoRA leaves nothing in the cache
        found = [self._field(i, plan.ref, self._hit_or_check, plan, targets) for i, plan in enumerate(plans)]
        out = [
            got if isinstance(got, ResolvedLora) else self._field(i, plan.ref, self._fetch, plan, targets, got)
            for i, (plan, got) in enumerate(zip(plans, found, strict=True))
        ]
        # (again by the bytes fetched: catalogue files first seen here are named by their sha256 only now)
        self._refuse_strengths([(r.content, r.label, r.strength) for r in out])
        return out

    def _refuse_early(self, refs: Sequence[LoraRef]) -> dict[str, tuple[int, int]]:
        """What is refused from the request and the worker alone; the runner's LoRA targets."""
        if not refs:
            return {}
        if len(refs) > self.settings.lora_max_per_request:
            raise LoraRefused(
                "loras",
                f"{len(refs)} LoRAs; this worker takes at most "
                f"{self.settings.lora_max_per_request} (LTX_LORA_MAX_PER_REQUEST)",
            )
        if not self.takes_loras:
            raise LoraRefused(
                "loras",
                f"runner {self.settings.runner!r} takes no request LoRAs as it is set up "
                "(LTX_RUNNER_SETUP; an ltx2 runner needs request_loras: true)",
            )
        try:
            return self.targets("loras")
        except LoraFileError as exc:
            raise LoraRefused("loras", f"cannot read the runner's checkpoint header ({exc})") from None

    def _refuse_plans(self, plans: Sequence[_Plan]) -> None:
        """Before any fetch: the job's distinct files (by what they are) within its share of the cache, and
        the strengths of one file within their bound in sum."""
        if not plans:
            return
        sizes = {plan.ident: plan.size for plan in plans}  # (the same file twice is held once)
        total, cap = sum(sizes.values()), self.cache.cap_bytes
        if total > cap:
            raise LoraRefused(
                "loras",
                f"lora_too_large: these LoRAs hold {total} bytes together, over the LoRA "
                f"cache's cap of {cap} (LTX_LORA_CACHE_BYTES)",
            )
        share_bytes, share_files, sharing = self.cache.share()
        if total > share_bytes or len(sizes) > share_files:
            raise LoraRefused(
                "loras",
                f"lora_too_large: these LoRAs hold {total} bytes in {len(sizes)} files, "
                f"over one job's share of the LoRA cache ({share_bytes} bytes, {share_files} "
                f"files: LTX_LORA_CACHE_BYTES and LTX_LORA_CACHE_FILES over the {sharing} "
                "worker processes sharing it)",
            )
        self._refuse_strengths([(plan.content, plan.ref.label, plan.ref.strength) for plan in plans])

    @staticmethod
    def _refuse_strengths(items: Sequence[tuple[str, str, float]]) -> None:
        """(content, label, strength) per LoRA: strengths of one content summed, named by its first label."""
        first_label: dict[str, str] = {}
        for content, label, _ in items:
            first_label.setdefault(content, label)
        if problem := strength_problem((first_label[content], strength) for content, _, strength in items):
            raise LoraRefused("loras", problem)

    @staticmethod
    def _field(i: int, ref: LoraRef, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` with its refusal naming `loras[i]`."""
        try:
            return fn(*args)
        except LoraFileError as exc:
            raise LoraRefused(f"loras[{i}]", f"{ref.label}: {_without_path(str(exc))}") from None
        except LoraRefused as exc:
            raise LoraRefused(f"loras[{i}]", exc.reason) from None

    def for_job(self, refs: Sequence[LoraRef], relay: Any, tenant: str | None = None) -> list[dict[str, Any]]:
        """`resolve` for one job: the fleet's `loras` kwarg; what was used goes into the job's summary
        (`loras`, shown by `producer status`). The files stay pinned until the next job resolves."""
        resolved = self.resolve(refs, tenant)
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

    def _plan(self, ref: LoraRef, tenant: str | None) -> _Plan:
        """Where `ref` comes from and how many bytes it holds, before anything is fetched."""
        if ref.name is not None:
            if self.catalogue is None:
                raise LoraRefused("", f"{ref.label}: this worker has no LoRA catalogue (LTX_LORA_CATALOGUE)")
            source = self._in_catalogue(self.catalogue / f"{ref.name}{_SUFFIX}")
            if source is None:
                raise LoraRefused("", f"{ref.label}: not in the catalogue")
            st = source.stat()
            if st.st_size > self.limits.max_file_bytes:  # (before the job's sum: the file's own limit first)
                raise LoraRefused(
                    "", f"{ref.label}: file is {st.st_size} bytes, over the {self.limits.max_file_bytes} byte limit"
                )
            memo = (str(source), st.st_size, st.st_mtime_ns)
            owner = (tenant or "") if self.per_tenant else ""
            digest = self._hashed.get(memo)  # (what its bytes are, once a job has copied them)
            content = f"sha256-{digest}" if digest else f"file:{source}"
            return _Plan(ref, f"file:{source}", st.st_size, content, owner, source=source, memo=memo)
        uri = str(ref.uri)
        if problem := uri_problem(uri, self.prefixes, self.shared, tenant if self.per_tenant else None):
            raise LoraRefused("", problem)
        client = self._s3_client() if self._s3_client is not None else None
        if client is None:
            raise LoraRefused("", f"{uri}: this worker has no S3 client (storage_backend is not s3)")
        bucket, key = split_s3_uri(uri)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise LoraRefused(
                "",
                f"{uri}: no such object ({code})"
                if code in ("404", "NoSuchKey", "NotFound")
                else f"{uri}: cannot read it ({code or exc})",
            ) from None
        except BotoCoreError as exc:
            raise LoraRefused("", f"{uri}: cannot read it ({exc})") from None
        size = int(head.get("ContentLength", 0))
        if size > self.limits.max_file_bytes:
            raise LoraRefused("", f"{uri}: object is {size} bytes, over the {self.limits.max_file_bytes} byte limit")
        etag = str(head.get("ETag", ""))
        owner = tenant if self.per_tenant else ""
        cache_key = (
            "s3-" + hashlib.sha256(f"{owner}\0{bucket}/{key}\0{etag.strip(chr(34))}\0{size}".encode()).hexdigest()
        )
        content = f"etag:{etag.strip(chr(34))}:{size}"
        return _Plan(
            ref, cache_key, size, content, owner or "", client=client, bucket=bucket, key=key, etag=etag or "*"
        )

    def _catalogue_key(self, digest: str, owner: str) -> str:
        """A catalogue file's cache key: its sha256, and with tenants the tenant's (module docstring)."""
        if not owner:
            return f"sha256-{digest}"
        return "cat-" + hashlib.sha256(f"{owner}\0{digest}".encode()).hexdigest()

    def _hit(self, plan: _Plan, targets: dict[str, tuple[int, int]]) -> ResolvedLora | None:
        """The plan's file from the cache, pinned and checked again; None on a miss (or a catalogue file whose
        sha256, its key, no job has computed yet)."""
        digest = self._hashed.get(plan.memo) if plan.memo is not None else None
        key = plan.ident if plan.source is None else self._catalogue_key(digest, plan.owner) if digest else None
        if key is None or (path := self.cache.get(key)) is None:
            return None
        return self._checked(plan.ref, path, targets, f"sha256-{digest}" if digest else plan.content)

    def _hit_or_check(self, plan: _Plan, targets: dict[str, tuple[int, int]]) -> ResolvedLora | float:
        """A hit (pinned, its header checked again), or a miss's header checked before any fetch: its seconds."""
        if (hit := self._hit(plan, targets)) is not None:
            return hit
        t0 = time.monotonic()
        if plan.source is not None:
            check_lora(plan.source, targets, self.limits)  # (a bad catalogue file is refused before its copy)
        else:  # (a bad header: refused before the body)
            check_remote_header(plan.client, plan.bucket, plan.key, plan.etag, plan.size, targets, self.limits)
        return time.monotonic() - t0

    def _fetch(self, plan: _Plan, targets: dict[str, tuple[int, int]], verify_s: float) -> ResolvedLora:
        """A miss fetched (catalogue: copied and hashed) into the cache, checked and committed, pinned. Its
        `fetch_s` counts its header check (`verify_s` so far) and this, not the other LoRAs' work between."""
        t0 = time.monotonic() - verify_s
        if (hit := self._hit(plan, targets)) is not None:  # (the same file earlier in this job)
            return hit
        if plan.source is not None:
            return self._from_catalogue(plan, targets, t0, verify_s)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            with self.cache.incoming(plan.size, wait_s=ROOM_WAIT_S) as tmp:
                # ranged GETs in parallel (a rank-128 LoRA at real size is 1.7 GB); IfMatch pins every range
                # to the object the HEAD sized, so a replaced object fails the fetch instead of mixing bytes
                ranged_download(plan.client, plan.bucket, plan.key, plan.etag, plan.size, tmp)
                verify_s += _timed(check_lora, tmp, targets, self.limits)
                path = self.cache.commit(tmp, plan.ident)
        except (ClientError, BotoCoreError) as exc:
            raise LoraRefused("", f"{plan.ref.uri}: fetch failed ({exc})") from None
        return self._fetched(plan.ref, path, plan.size, time.monotonic() - t0, verify_s, plan.content)

    def _from_catalogue(self, plan: _Plan, targets: dict, t0: float, verify_s: float) -> ResolvedLora:
        assert plan.source is not None and plan.memo is not None
        with self.cache.incoming(plan.size, wait_s=ROOM_WAIT_S) as tmp:
            digest = copy_hashing(plan.source, tmp)
            self._hashed[plan.memo] = digest
            key, content = self._catalogue_key(digest, plan.owner), f"sha256-{digest}"
            if (hit := self.cache.get(key)) is not None:  # (committed meanwhile by another group's job)
                return self._checked(plan.ref, hit, targets, content)
            verify_s += _timed(check_lora, tmp, targets, self.limits)
            path = self.cache.commit(tmp, key)
        return self._fetched(plan.ref, path, plan.size, time.monotonic() - t0, verify_s, content)

    def _checked(self, ref: LoraRef, path: Path, targets: dict, content: str) -> ResolvedLora:
        verify_s = _timed(check_lora, path, targets, self.limits)  # header only: cheap, guards the cache folder too
        if self.metrics is not None:
            self.metrics.lora_cache.labels(self.group, "hit").inc()
        return ResolvedLora(ref.label, str(path), ref.strength, cached=True, verify_s=verify_s, content=content)

    def _fetched(
        self, ref: LoraRef, path: Path, size: int, seconds: float, verify_s: float, content: str
    ) -> ResolvedLora:
        if self.metrics is not None:
            self.metrics.lora_cache.labels(self.group, "miss").inc()
            self.metrics.lora_fetch_bytes.labels(self.group).inc(size)
            self.metrics.lora_fetch_seconds.labels(self.group).observe(seconds)
        fetched = {"fetch_bytes": size, "fetch_s": seconds, "verify_s": verify_s, "content": content}
        return ResolvedLora(ref.label, str(path), ref.strength, cached=False, **fetched)


def runner_takes_loras(runner_cls: Any, setup: dict[str, Any]) -> bool:
    """Whether the runner fuses request LoRAs as it is set up (`MGPURunner.takes_request_loras`; a runner class
    without it: its job signature names `loras`)."""
    import inspect

    takes = getattr(runner_cls, "takes_request_loras", None)
    if callable(takes):
        return bool(takes(**setup))
    try:
        return "loras" in inspect.signature(runner_cls.__call__).parameters
    except (TypeError, ValueError):
        return False


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds `fn(*args)` took (it raises through)."""
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


def _without_path(message: str) -> str:
    """`check_lora` names the file it read; a client needs what is wrong, not the worker's cache path."""
    head, sep, tail = message.partition(": ")
    return tail if sep and (os.sep in head or head.endswith(_SUFFIX)) else message
