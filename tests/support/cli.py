"""The producer CLI in-process, as its tests drive it: `run(args, env)` -> (exit code, stdout, stderr) and
`write` for a request file. The environment each CLI test runs with (its own queue and client on the real
Redis) is the `env` fixture of tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner


def run(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """`producer ARGS` with `env` as its environment; an unexpected exception propagates (no exit code hides it)."""
    from producer.cli import cli

    result = CliRunner().invoke(cli, args, env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def write(tmp_path: Path, name: str, text: str) -> str:
    """`text` in `tmp_path/name`; returns the path as the CLI takes it."""
    path = tmp_path / name
    path.write_text(text)
    return str(path)
