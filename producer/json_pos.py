"""Where each member of a JSON document sits in its text, so validation errors can name a line and column.

The standard `json` module reports positions only for syntax errors. A pydantic error names a field path
(`("width",)`), and a user fixing a 3,000-line JSON Lines file needs `prompts.jsonl:1207:31`. This module
walks text that `json.loads` already accepted and maps every path to the position of its key (object
members) or value (array items). It never decides validity itself: run it only on text that parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from json.decoder import scanstring

__all__ = ["Position", "locate", "position_at"]

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # json.loads accepts the last three

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Position:
    """A 1-based line and column, as editors and compilers print them."""

    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.line}:{self.column}"


def position_at(text: str, offset: int, *, first_line: int = 1) -> Position:
    """The line/column of a character offset; `first_line` shifts lines for a slice of a larger file."""
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return Position(first_line + line, offset - start + 1)


def locate(text: str) -> dict[Path, int]:
    """Map each JSON path in `text` to a character offset.

    The root maps to `()`. An object member maps to the offset of its key's opening quote (so an unknown
    field points at its name), an array item to the offset of the item. Raises ValueError on text that is
    not JSON (callers parse with `json.loads` first and report its error instead).
    """
    offsets: dict[Path, int] = {}
    end = _value(text, _skip(text, 0), (), offsets)
    if _skip(text, end) != len(text):
        raise ValueError("trailing data")
    return offsets


def _skip(text: str, index: int) -> int:
    match = _WS.match(text, index)
    return match.end() if match else index


def _value(text: str, index: int, path: Path, offsets: dict[Path, int]) -> int:
    """Record `path` at `index` unless a key already claimed it; return the offset just past the value."""
    offsets.setdefault(path, index)
    if index >= len(text):
        raise ValueError("unexpected end of JSON")
    char = text[index]
    if char == "{":
        return _object(text, index + 1, path, offsets)
    if char == "[":
        return _array(text, index + 1, path, offsets)
    if char == '"':
        return scanstring(text, index + 1)[1]
    for literal in _LITERALS:
        if text.startswith(literal, index):
            return index + len(literal)
    number = _NUMBER.match(text, index)
    if number:
        return number.end()
    raise ValueError(f"unexpected character {char!r} at offset {index}")


def _object(text: str, index: int, path: Path, offsets: dict[Path, int]) -> int:
    index = _skip(text, index)
    if text[index] == "}":
        return index + 1
    while True:
        key_start = index
        key, index = scanstring(text, index + 1)
        index = _skip(text, index)
        if text[index] != ":":
            raise ValueError(f"expected ':' at offset {index}")
        offsets[(*path, key)] = key_start  # later duplicates win, as json.loads keeps the last value
        index = _value(text, _skip(text, index + 1), (*path, key), offsets)
        index = _skip(text, index)
        if text[index] == "}":
            return index + 1
        if text[index] != ",":
            raise ValueError(f"expected ',' or '}}' at offset {index}")
        index = _skip(text, index + 1)


def _array(text: str, index: int, path: Path, offsets: dict[Path, int]) -> int:
    index = _skip(text, index)
    if text[index] == "]":
        return index + 1
    item = 0
    while True:
        index = _value(text, index, (*path, item), offsets)
        index = _skip(text, index)
        if text[index] == "]":
            return index + 1
        if text[index] != ",":
            raise ValueError(f"expected ',' or ']' at offset {index}")
        index = _skip(text, index + 1)
        item += 1
