"""Frozen dataclasses as the JSON objects that cross Redis between workers and the producer (the health
snapshot, the hand-off result): one definition both sides read, instead of dict literals on one side and
string keys on the other.

`dump(obj)` gives the JSON object (keys in field order; lists for tuples; a field whose metadata says
`omit_none` is left out while None). `load(cls, data, where)` reads one back: a missing key takes the
field's default (an older writer), an unknown key is ignored (a newer writer), and a value of the wrong
type, or a missing key the field has no default for, raises `SnapshotError` naming the field, in one
line. Field types are the few JSON has: str, int, float, bool, None unions, `tuple[X, ...]`,
`dict[str, Any]` (kept as it is) and nested dataclasses.
Stdlib only (the producer image copies ltx_contract/).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from ltx_contract.errors import ContractError

__all__ = ["OMIT_NONE", "SnapshotError", "dump", "load"]

T = TypeVar("T")

#: Field metadata: leave the key out of the JSON while the value is None.
OMIT_NONE = {"omit_none": True}


class SnapshotError(ContractError, ValueError):
    """A JSON object does not have the shape its dataclass says (the message is one line)."""


def dump(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dump(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def load(cls: type[T], data: Any, where: str) -> T:
    if not isinstance(data, dict):
        raise SnapshotError(f"{where}: expected an object, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            kwargs[f.name] = _value(data[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SnapshotError(f"{where}.{f.name}: missing")
    return cls(**kwargs)


def _value(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        if len(inner) == 1:
            return _value(value, inner[0], where)
        raise TypeError(f"{where}: unsupported field type {tp}")  # (a programming error, not bad data)
    if origin is tuple:
        if not isinstance(value, list):
            raise SnapshotError(f"{where}: expected a list, got {_kind(value)}")
        (item, _) = typing.get_args(tp)
        return tuple(_value(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SnapshotError(f"{where}: expected an object, got {_kind(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return load(tp, value, where)
    if tp is Any:
        return value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise SnapshotError(f"{where}: expected {tp.__name__}, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
