"""A LoRA named in a render request (`RenderRequest.loras`): the shape of the field, checked at the edge.

A request names a LoRA and never a worker path: either `name`, a file of the operator's catalogue
(`LTX_LORA_CATALOGUE`, a folder of `<name>.safetensors`), or `uri`, an `s3://bucket/key` object under a
prefix the operator allows (`LTX_LORA_S3_PREFIXES`). With tenants (`LTX_TENANT_IDS`: a job's tenant is its
id's prefix, the producer's client) a `uri` must be under `<allowed prefix>/<tenant>/` or a shared read-only
prefix (`LTX_LORA_SHARED_PREFIXES`): `uri_problem` is that rule, used by the producer at submit and by the
worker, and it answers before any object is looked at (the same words whether the object exists or not).
What this module checks is what any worker would refuse (syntax, count, a finite strength in range, strengths
of one file in sum); which names and prefixes exist is the worker's
(`worker.render.loras`), and the file itself is checked from its header before any fleet sees it
(`ltx_mgpu.lora_file`). Imports only pydantic, so the producer uses it without torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "MAX_LORAS",
    "MAX_LORA_STRENGTH",
    "LoraRef",
    "parse_lora_option",
    "split_s3_uri",
    "strength_problem",
    "tenant_prefixes",
    "uri_allowed",
    "uri_problem",
]

MAX_LORAS = 8  #: LoRAs per request, structurally (a worker may allow fewer: `LTX_LORA_MAX_PER_REQUEST`)
MAX_LORA_STRENGTH = 4.0  #: |strength|; past this a LoRA's delta swamps the weight it is added to
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  #: a file name stem: no path separator, no leading dot
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` -> (bucket, key); ValueError naming what is wrong."""
    if not uri.startswith("s3://"):
        raise ValueError(f"must be s3://bucket/key, got {uri[:80]!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"bucket {bucket[:80]!r} is not a valid S3 bucket name")
    if not key or key.endswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"key {key[:200]!r} must name an object (no empty, '.' or '..' segments)")
    if not key.endswith(".safetensors"):
        raise ValueError(f"key {key[:200]!r} must end in .safetensors (only safetensors LoRAs are loaded)")
    return bucket, key


def uri_allowed(uri: str, prefixes: list[str]) -> bool:
    """Whether `uri` is inside one of `prefixes` (`bucket` or `bucket/folder`). Both match whole: the bucket
    by name and the folder by path segments, so `loras/shared` (with or without its trailing `/`) allows
    `loras/shared/a.safetensors` but never `loras/shared-private/...` or `loras/sharedbackup/...`, which a
    string prefix let a tenant read with the worker's bucket-wide key."""
    bucket, key = split_s3_uri(uri)
    for prefix in prefixes:
        allowed_bucket, _, folder = prefix.partition("/")
        folder = folder.strip("/")
        if bucket == allowed_bucket and (not folder or key.startswith(folder + "/")):
            return True
    return False


def tenant_prefixes(prefixes: Sequence[str], tenant: str) -> list[str]:
    """`tenant`'s own folder under each allowed prefix: `bucket/loras/` -> `bucket/loras/<tenant>/`."""
    out = []
    for prefix in prefixes:
        bucket, _, key_prefix = prefix.partition("/")
        if key_prefix and not key_prefix.endswith("/"):
            key_prefix += "/"
        out.append(f"{bucket}/{key_prefix}{tenant}/")
    return out


def uri_problem(uri: str, prefixes: Sequence[str], shared: Sequence[str] = (), tenant: str | None = None) -> str | None:
    """Why `uri` may not be read for this job (None: it may): under a shared prefix, or under an allowed prefix,
    that is `<prefix>/<tenant>/` when the job has a tenant. Decided from the uri alone, never the object."""
    if uri_allowed(uri, list(shared)):
        return None
    if tenant is None:
        if uri_allowed(uri, list(prefixes)):
            return None
        return f"{uri}: under no prefix this worker allows (LTX_LORA_S3_PREFIXES)"
    own = tenant_prefixes(list(prefixes), tenant)
    if uri_allowed(uri, own):
        return None
    where = ", ".join(own + list(shared)) or "none"
    return f"{uri}: not under tenant {tenant!r}'s LoRA prefixes or a shared one (allowed: {where})"


def strength_problem(items: Iterable[tuple[str, float]]) -> str | None:
    """Why these (file, strength) pairs may not be fused (None: they may): the strengths of one file add up
    (fused 4 times at 4 it acts as 16), so their sum per file is bounded like one strength. The request
    schema names a file by its name or uri; the worker by its resolved content (copies under other keys)."""
    totals: dict[str, float] = {}
    for label, strength in items:
        totals[label] = totals.get(label, 0.0) + strength
    for label, total in totals.items():
        if abs(total) > MAX_LORA_STRENGTH:
            return f"{label}: strengths add up to {total:g} for one file; at most {MAX_LORA_STRENGTH:g} in sum"
    return None


class LoraRef(BaseModel):
    """One LoRA to fuse for this job: exactly one of `name` (catalogue) or `uri` (S3), and a strength."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    name: str | None = Field(default=None, pattern=NAME_PATTERN, description="a LoRA of the worker's catalogue")
    uri: str | None = Field(default=None, max_length=1024, description="s3://bucket/key.safetensors")
    strength: float = Field(default=1.0, ge=-MAX_LORA_STRENGTH, le=MAX_LORA_STRENGTH, allow_inf_nan=False)

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        if value is not None:
            split_s3_uri(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> LoraRef:
        if (self.name is None) == (self.uri is None):
            raise ValueError("give exactly one of 'name' (the worker's catalogue) or 'uri' (s3://bucket/key)")
        return self

    @property
    def label(self) -> str:
        """How events and `producer status` name it."""
        return self.name if self.name is not None else str(self.uri)


def parse_lora_option(text: str) -> LoraRef:
    """`NAME`, `NAME:STRENGTH`, `s3://bucket/key` or `s3://bucket/key:STRENGTH` (the producer's `--lora`)."""
    source, strength = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head and head != "s3":
        try:
            strength = float(tail)
        except ValueError:
            raise ValueError(f"--lora {text!r}: strength {tail!r} is not a number") from None
        source = head
    field = "uri" if source.startswith("s3://") else "name"
    return LoraRef.model_validate({field: source, "strength": strength})
