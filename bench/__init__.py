"""Benchmarks, run as modules from the checkout: `python -m bench.<name> --help`.

Each prints one JSON line per measurement and a last `SUMMARY ...` line (`bench.common`); its module
docstring states what it measures and how. Shared code lives in `bench.common` (output, clocks) and
`bench.block` (the benchmark transformer block); the service end to end is one tool, `python -m bench.e2e`.
"""
