"""`producer submit --lora NAME[:STRENGTH]`: LoRAs added to every request of a file, and checked at the edge.

The schema (`ltx_contract.lora_refs`) holds what any worker refuses (syntax, count, strength). What a worker
offers (its catalogue's names, its allowed S3 prefixes, how many LoRAs per request) is in its health
snapshot (`loras`, published by `worker.render.loras.LoraResolver.published`); a request is checked against every
live worker on the target queue, since any of them may take the job. The file itself is checked only in
the worker: its contents are not the producer's to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError
from rq.worker import Worker

from ltx_contract.health import LoraOffer, SnapshotError, read_health
from ltx_contract.keys import worker_health_key
from ltx_contract.lora_refs import LoraRef, parse_lora_option, uri_problem
from ltx_contract.schema import RenderRequest
from producer.models import unavailable_on_error
from producer.request_file import LoadedRequest, describe_error

__all__ = ["first_lora_problem", "lora_problems", "published_loras", "with_lora_options"]


def with_lora_options(requests: Sequence[LoadedRequest], options: Sequence[str]) -> list[LoadedRequest]:
    """Each request with the `--lora` options appended to its own `loras` (ValueError naming the bad one)."""
    if not options:
        return list(requests)
    refs = []
    for text in options:
        try:
            refs.append(parse_lora_option(text))
        except ValidationError as exc:
            raise ValueError(f"--lora {text!r}: {describe_error(exc.errors(include_url=False)[0])}") from None
    flags = " ".join(f"--lora {text}" for text in options)
    out = []
    for loaded in requests:
        data = loaded.request.model_dump(exclude_none=True)
        data["loras"] = [*data.get("loras", []), *(r.model_dump(exclude_none=True) for r in refs)]
        try:
            request = RenderRequest.model_validate(data)
        except ValidationError as exc:
            # (the file's own request was valid: what fails is what the flags added to it)
            problem = describe_error(exc.errors(include_url=False)[0])
            raise ValueError(f"{flags} on {loaded.source}: {problem}") from None
        out.append(replace(loaded, request=request))
    return out


def published_loras(connection: Any, queue: Any) -> list[tuple[str, LoraOffer]]:
    """(worker name, what it publishes under `loras`) for the live workers on `queue` that publish it."""
    out = []
    with unavailable_on_error():
        for worker in Worker.all(connection=connection, queue=queue):
            try:
                health = read_health(connection.get(worker_health_key(worker.name)))
            except SnapshotError:
                continue  # (`producer stats` names the worker and what is wrong with its snapshot)
            if health is not None and health.loras is not None:
                out.append((worker.name, health.loras))
    return out


def lora_problems(
    request: RenderRequest, offers: Sequence[tuple[str, LoraOffer]], tenant: str | None = None
) -> list[str]:
    """What any of these workers would refuse in `request.loras` (any of them may take the job); `tenant`: the
    client whose folder a uri must be in where a worker has tenants (`ltx_contract.lora_refs.uri_problem`)."""
    problems: dict[str, None] = {}
    refs = request.loras or []
    for worker, offer in offers:
        for message in _refused_by(refs, offer, tenant):
            problems.setdefault(f"{message} (worker {worker})")
    return list(problems)


def _refused_by(refs: Sequence[LoraRef], offer: LoraOffer, tenant: str | None) -> list[str]:
    out = []
    cap = offer.max_per_request
    if cap is not None and len(refs) > cap:
        out.append(f"loras: {len(refs)} LoRAs, the worker takes at most {cap}")
    owner = tenant if offer.per_tenant else None
    for i, ref in enumerate(refs):
        if ref.name is not None and offer.names is not None and not offer.names:
            out.append(
                f"loras[{i}].name: {ref.name!r}: the worker has no LoRA catalogue (LTX_LORA_CATALOGUE "
                "unset or empty); name the file by `uri` instead"
            )
        elif ref.name is not None and offer.names is not None and ref.name not in offer.names:
            out.append(f"loras[{i}].name: {ref.name!r} is not in the worker's catalogue")
        if ref.uri is not None and (problem := uri_problem(ref.uri, offer.s3_prefixes, offer.shared_prefixes, owner)):
            out.append(f"loras[{i}].uri: {problem}")
    return out


def first_lora_problem(
    connection: Any, queue: Any, requests: Sequence[LoadedRequest], tenant: str | None = None
) -> str | None:
    """ "FILE:LINE: what is wrong" for the first request whose LoRAs a live worker on `queue` would refuse."""
    if not any(loaded.request.loras for loaded in requests):
        return None
    offers = published_loras(connection, queue)
    for loaded in requests:
        if problems := lora_problems(loaded.request, offers, tenant):
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return f"{loaded.source}: {problems[0]}{more}"
    return None
