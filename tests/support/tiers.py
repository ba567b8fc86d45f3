"""Which tier a test belongs to. `tests/conftest.py` (`pytest_collection_modifyitems`) marks every collected
test with exactly one tier through `tier_of`; nothing else assigns tiers. README, "Tests", says what each costs.

- `chaos`: tests/chaos/, the randomised fault campaigns against a whole stack;
- `gpu`: marked `gpu` or in a `*_gpu.py` module: need a CUDA device (they skip without one);
- `meta`: checks of the tree itself (file sizes, import contracts, docs against code, pins, compose file);
- `integration`: real servers or real processes: any test that uses a Redis, S3 or proxy fixture (directly or
  through another fixture), and the modules in `PROCESS_MODULES`, which start `ltx-worker`s, subprocess
  clients or multi-rank CPU fleets without one;
- `unit`: the rest: in-process, at most a short-lived local world.

`FAST` are the tiers `bash scripts/test.sh` (the README's command) runs; `.ci/run` runs them, then
`-m "not (FAST)"`: the complement, so every test runs in CI whatever its tier.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

TIERS = ("unit", "integration", "chaos", "gpu", "meta")
FAST = ("unit", "meta", "gpu")

#: Fixtures (tests/conftest.py) that start a server or proxy; `redis_url`, `redis_client` and `s3_client`
#: depend on them, and pytest lists a test's fixtures transitively, so those count too.
SERVER_FIXTURES = frozenset({"redis_server", "redis_server_factory", "s3_server", "tcp_proxy_factory"})

#: Modules whose checks read the tree rather than run the product.
META_MODULES = frozenset({
    "test_structure", "test_import_contracts", "test_control_plane_contract", "test_docs_sync",
    "test_constraints", "test_compose", "test_numerics_script", "test_runner_registry", "test_tiers",
    "test_error_hierarchy", "test_bench_package", "test_scripts",
})  # fmt: skip

#: Modules that start processes (fleets of several CPU ranks, `ltx-worker`, CLI subprocesses, bench scripts)
#: in most of their tests without a server fixture: seconds to a minute each on 2 cores.
PROCESS_MODULES = frozenset({
    "test_controller", "test_controller_channels", "test_controller_faults", "test_graph_ready",
    "test_guidance_parallel", "test_job_loras", "test_leftovers", "test_lora_device_cache", "test_ltx2_layouts",
    "test_ltx2_oom", "test_ltx2_runners", "test_memplan_loras", "test_oslimits", "test_producer_demo",
    "test_smoke_runner", "test_sp_parallel", "test_sp_scaling_bench", "test_synthetic", "test_tdp",
    "test_text_encoder", "test_vae_decode", "test_worker_units", "test_bench_attention",
    "test_bench_e2e", "test_bench_loras", "test_fp8_runners", "test_fp8_lora_kernel", "test_cancel_points",
    "test_audio", "test_kernels_host", "test_doc_stack", "test_memplan", "test_lora_tracker", "test_layout", "test_fp8",
})  # fmt: skip


def tier_of(path: Path, fixturenames: Iterable[str], markers: Iterable[str]) -> str:
    """The one tier of the test in module `path` that uses `fixturenames` and carries `markers`."""
    if "chaos" in path.parts:
        return "chaos"
    if "gpu" in markers or path.stem.endswith("_gpu"):
        return "gpu"
    if path.stem in META_MODULES:
        return "meta"
    if SERVER_FIXTURES & set(fixturenames) or path.stem in PROCESS_MODULES:
        return "integration"
    return "unit"


def fast_expression(tiers: Iterable[str] = FAST) -> str:
    """The `-m` expression selecting `tiers`; `not (...)` of it selects every other test."""
    return " or ".join(tiers)
