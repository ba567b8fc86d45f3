"""`python -m bench.e2e [runs|loras] ...`: the mode's own arguments follow its name (see `bench.e2e`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import bench.e2e
from bench.e2e import loras, runs

MODES: dict[str, Callable[[list[str] | None], int]] = {"runs": runs.main, "loras": loras.main}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the mode named first (`runs` when the first argument is an option)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in MODES:
        return MODES[args[0]](args[1:])
    if args and args[0] in ("-h", "--help"):
        print(bench.e2e.__doc__)
        return 0
    if args and not args[0].startswith("-"):
        print(f"unknown mode {args[0]!r}: one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    return runs.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
