"""Request-level specs shared by the engine, the worker and the producer (stdlib only, no torch).

- `bounds`: the request ranges and the audio/SP token budget arithmetic.
- `request_rules`: the size and duration rules a runner publishes and every side checks (`RequestRules`).
- `image_size`: the header-only image size check (both the schema and the runners' decoder refuse the same files).
- `memory_plan`: the per-job memory plan (what fits, chunked decode, releasing caches between stages).
- `memory_profile`: the model profiles the memory plan counts with.

The producer image ships `ltx_mgpu/__init__.py`, `ltx_mgpu/errors.py` and this package only (Dockerfile, beside the
client contract `ltx_contract`, whose request schema and limits use them); the import contracts
(`tests/test_import_contracts.py`) keep every module here stdlib-only.
"""
