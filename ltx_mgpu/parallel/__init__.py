"""Sequence parallelism (SP) for the LTX-2 transformer and the other parallel parts of a fleet: the data plane.

Subpackages, one concern each (lowest first; a subpackage imports only those before it, tests/test_import_contracts.py):
- `sharding/`: the token partition and the small collectives every parallelism uses
- `graphs/`: the graph-ready forward (hoisting, capture-aware caches, CUDA-graph capture/replay, the host-sync audit)
- `sp/`: the SP core (all2all head exchange and its backends, attention callables, the model wrapper and builder)
- `layouts/`: G guidance groups x S SP ranks (groups, attention router, cost model, guidance-parallel passes)
- `pipeline/` (over `sharding/` and `graphs/`): tiled data parallelism, distributed VAE decode and prompt encoding
- `lora/` (over `sharding/`): the LoRA tracker
- `testing.py`: `LocalWorld`, process worlds for tests and benchmarks (no product module imports it)

Public API (see docs/sequence-parallel.md):
- partition: `compute_sequence_partition`, `compute_sequence_offsets`, `pad_modality_for_uniform_sharding`,
  `tile_modality_for_rank`, `padded_token_count`
- all2all: `All2AllBackend` (protocol), `register_backend`, `get_backend_factory`, `available_backends`,
  custom ops `torch.ops.ltx_mgpu.{send_recv_heads,gather_heads,all_gather_heads}`
- `AttentionManager`, `All2AllAttention`, `AudioAll2AllAttention`
- `SequenceParallelModelWrapper`, `SequenceParallelBuilder`, `create_sp_module_ops`, `patch_sp_attention`
- layouts (guidance groups x SP ranks): `ParallelLayout`, `LayoutGroups`, `AttentionRouter`,
  `GuidanceParallelPasses`, `split_passes`; the cost model `CostModel`, `LayerDims`, `LayoutPolicy`,
  `choose_layout`
- graph-ready forward: `ForwardHoister` (hoisting caches), `CudaGraphForward` (capture/replay),
  `HostSyncAudit` (finds host syncs and copies on CPU)

Nothing here imports the CUDA kernel module eagerly: `AttentionManager(backend="auto")` imports it lazily,
so this package imports (and its tests run) on CPU-only installs.
"""

from __future__ import annotations

from .graphs.cuda_graph import CudaGraphForward
from .graphs.graph_audit import HostSyncAudit
from .graphs.hoist import ForwardHoister
from .layouts.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    LayerDims,
    LayoutChoice,
    LayoutPolicy,
    StepShape,
    choose_layout,
)
from .layouts.guidance import GuidanceParallelPasses, split_passes
from .layouts.layout import LayoutGroups, LayoutRank, ParallelLayout
from .layouts.router import AttentionRouter
from .sharding.partition import (
    compute_sequence_offsets,
    compute_sequence_partition,
    pad_modality_for_uniform_sharding,
    padded_token_count,
    tile_modality_for_rank,
)
from .sp.all2all import All2AllBackend, available_backends, get_backend_factory, register_backend
from .sp.attention import DEFAULT_ALL2ALL_TIMEOUT_S, All2AllAttention, AttentionManager, AudioAll2AllAttention
from .sp.builder import SequenceParallelBuilder, create_sp_module_ops, patch_sp_attention
from .sp.wrapper import SequenceParallelModelWrapper, check_token_budget

__all__ = [
    "DEFAULT_ALL2ALL_TIMEOUT_S",
    "DEFAULT_COST_MODEL",
    "All2AllAttention",
    "All2AllBackend",
    "AttentionManager",
    "AttentionRouter",
    "AudioAll2AllAttention",
    "CostModel",
    "CudaGraphForward",
    "ForwardHoister",
    "GuidanceParallelPasses",
    "HostSyncAudit",
    "LayerDims",
    "LayoutChoice",
    "LayoutGroups",
    "LayoutPolicy",
    "LayoutRank",
    "ParallelLayout",
    "SequenceParallelBuilder",
    "SequenceParallelModelWrapper",
    "StepShape",
    "available_backends",
    "check_token_budget",
    "choose_layout",
    "compute_sequence_offsets",
    "compute_sequence_partition",
    "create_sp_module_ops",
    "get_backend_factory",
    "pad_modality_for_uniform_sharding",
    "padded_token_count",
    "patch_sp_attention",
    "register_backend",
    "split_passes",
    "tile_modality_for_rank",
]
