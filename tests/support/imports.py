"""What a module imports, read from its source (AST) so an import inside a function counts too: the import
contracts (tests/test_import_contracts.py, tests/test_control_plane_contract.py) and the producer image's file
list (tests/test_compose.py) read imports this one way."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(source: str, module: str, *, type_checking: bool = True) -> set[str]:
    """Every module `source` (the text of dotted `module`) imports anywhere, relative imports resolved.
    `from a import b` yields both `a` and `a.b` (b may be a submodule). With `type_checking=False` the
    imports under `if TYPE_CHECKING:` are left out (they never run)."""
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    tree = ast.parse(source)
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def module_file(root: Path, name: str) -> Path | None:
    """The file of dotted module `name` below `root` (`a/b.py` or `a/b/__init__.py`), None if there is none
    (a name imported from a module, or a third-party module)."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def import_closure(root: Path, starts: list[str]) -> dict[str, Path]:
    """{module: its file} for every module of the tree at `root` that importing `starts` can run, lazy imports
    included: each start, what it imports anywhere in its source but under `if TYPE_CHECKING:`, the packages
    above each (Python runs their `__init__` first), and so on. Third-party modules (no file below `root`) are
    left out."""
    found: dict[str, Path] = {}
    todo = list(starts)
    while todo:
        name = todo.pop()
        if name in found or (path := module_file(root, name)) is None:
            continue
        found[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        own = f"{name}.__init__" if path.name == "__init__.py" else name  # (relative imports of a package)
        todo += sorted(imported_modules(path.read_text(), own, type_checking=False))
    return found
