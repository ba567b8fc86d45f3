"""Reading render requests from a file the user wrote: one JSON object, or JSON Lines of several.

Validation uses the worker's own `RenderRequest`, so anything accepted here is accepted by the worker.
Every problem becomes a `RequestFileError` whose one-line message names the file, the line and column,
and the field (`prompts.jsonl:12:5: width: must be a multiple of 32, got 100`), because the person
reading it is fixing a file, not debugging a program.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ltx_contract.schema import RenderRequest
from producer.errors import ProducerError
from producer.json_pos import Position, locate, position_at

__all__ = ["LoadedRequest", "RequestFileError", "describe_error", "error_location", "load_requests", "validate_request"]

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")


class RequestFileError(ProducerError, ValueError):
    """A user error in a request file; `str()` is the complete one-line message."""


@dataclass(frozen=True)
class LoadedRequest:
    """One validated request and where it came from (for messages and manifests)."""

    request: RenderRequest
    source: str  #: "file:line" of the object's first character
    index: int  #: 0-based position among the file's requests


def load_requests(path: str | Path) -> list[LoadedRequest]:
    """Read and validate every request in `path` ("-" reads stdin).

    A `.jsonl`/`.ndjson` file, or any file whose text is not one JSON document, is read as JSON Lines
    (blank lines skipped). Raises RequestFileError at the first problem.
    """
    name = str(path)
    text = _read(name)
    try:
        return _load(text, name)
    except RecursionError:  # (json and pydantic recurse per level: a 200k-level document)
        raise RequestFileError(f"{name}: nested too deeply to be a request") from None


def _load(text: str, name: str) -> list[LoadedRequest]:
    if not text.strip():
        raise RequestFileError(f"{name}: no requests (the file is empty)")
    if not name.endswith(JSON_LINES_SUFFIXES):
        try:
            document = _parse_json(text, name)
        except json.JSONDecodeError as exc:
            if exc.msg != "Extra data":
                raise RequestFileError(f"{name}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        else:
            return [_validate(document, text, name, first_line=1, index=0)]
    return list(_load_lines(text, name))


#: Longest integer literal read (no request field takes more than 10 digits). Python refuses to convert one
#: of over 4300 digits with a ValueError that escaped as a traceback.
MAX_INTEGER_DIGITS = 100


class _LongInteger(ProducerError, ValueError):
    pass


def _parse_json(text: str, name: str, *, first_line: int = 1) -> Any:
    """`json.loads`, refusing an integer literal longer than `MAX_INTEGER_DIGITS` with its position."""

    def bounded_int(literal: str) -> int:
        if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
            raise _LongInteger(literal)
        return int(literal)

    try:
        return json.loads(text, parse_int=bounded_int)
    except _LongInteger:
        found = re.search(rf"-?\d{{{MAX_INTEGER_DIGITS + 1},}}", text)
        where = f":{position_at(text, found.start(), first_line=first_line)}" if found else ""
        digits = len(found.group().lstrip("-")) if found else MAX_INTEGER_DIGITS + 1
        raise RequestFileError(
            f"{name}{where}: an integer of {digits} digits; no request field takes one longer than {MAX_INTEGER_DIGITS}"
        ) from None


def validate_request(data: Any, *, source: str = "<request>") -> RenderRequest:
    """Validate an already-parsed request (the Python API path); errors carry no file position."""
    return _validate(data, None, source, first_line=1, index=0).request


def _read(name: str) -> str:
    try:
        if name == "-":
            return sys.stdin.read()
        return Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RequestFileError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise RequestFileError(f"{name}: is a directory, not a request file") from None
    except UnicodeDecodeError as exc:
        raise RequestFileError(f"{name}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise RequestFileError(f"{name}: cannot read: {exc.strerror or exc}") from None


def _load_lines(text: str, name: str) -> Iterator[LoadedRequest]:
    index = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            document = _parse_json(line, name, first_line=number)
        except json.JSONDecodeError as exc:
            where = f"{name}:{number}:{exc.colno}"
            hint = " (JSON Lines needs one complete object per line)" if exc.msg.startswith("Expecting") else ""
            raise RequestFileError(f"{where}: invalid JSON: {exc.msg}{hint}") from None
        yield _validate(document, line, name, first_line=number, index=index)
        index += 1


def _validate(document: Any, text: str | None, name: str, *, first_line: int, index: int) -> LoadedRequest:
    offsets = locate(text) if text is not None else {}

    def where(path: tuple[str | int, ...]) -> str:
        # The deepest located prefix of the error path: a missing field points at its object.
        for cut in range(len(path), -1, -1):
            offset = offsets.get(path[:cut])
            if offset is not None and text is not None:
                return f"{name}:{position_at(text, offset, first_line=first_line)}"
        return name if text is None else f"{name}:{Position(first_line, 1)}"

    if not isinstance(document, dict):
        kind = type(document).__name__ if document is not None else "null"
        kind = {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean"}.get(kind, kind)
        raise RequestFileError(f"{where(())}: expected a JSON object (a request), got {kind}")
    try:
        request = RenderRequest.model_validate(document)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise RequestFileError(f"{where(error_location(first))}: {describe_error(first)}{more}") from None
    return LoadedRequest(request=request, source=where(()), index=index)


def error_location(error: dict[str, Any]) -> tuple[str | int, ...]:
    """Where a pydantic error points: its `loc`; for a check of the whole request (no `loc`) the request field
    its message begins with ("loras: ...", "images[0].frame ..."), so a file position points at that field."""
    loc = tuple(error["loc"])
    named = re.match(r"(?:Value error, )?([a-z_]+)\b", str(error["msg"])) if not loc else None
    return (named.group(1),) if named and named.group(1) in RenderRequest.model_fields else loc


def describe_error(error: dict[str, Any]) -> str:
    """One readable clause for one pydantic error, naming the field. A check of the whole request names its
    field in its own message, and the value it refused is the whole request: not echoed (it was, in full)."""
    loc = tuple(error["loc"])
    field = ".".join(str(part) for part in loc) or "request"
    kind = error["type"]
    if kind == "extra_forbidden":
        known = list(RenderRequest.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(known)}"
        return f"unknown field '{field}'{hint}"
    if kind == "missing":
        return f"missing required field '{field}'"
    message = str(error["msg"])
    message = message.removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if not loc:
        return message
    shown = _shown(error.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    got = "" if "got" in message else f" (got {shown})"
    return f"{field}: {message}{got}"


def _shown(value: Any) -> str:
    """repr() of a refused value; an integer too long for Python to print (the API path: no file to parse)
    is described by its size instead of raising."""
    try:
        return repr(value)
    except ValueError:
        return f"an integer of about {int(math.log10(abs(value))) + 1} digits" if isinstance(value, int) else "?"
