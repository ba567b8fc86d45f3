"""The out-of-memory report (`ltx_mgpu.control.memory_report`): pools split by the snapshot's pool ids, tensors
grouped with each storage counted once. CPU tensors stand in for device ones (the grouping is device-blind)."""

from __future__ import annotations

import torch

from ltx_mgpu.control.memory_report import live_memory_report, pool_usage, tensor_groups


def test_pool_usage_splits_the_default_pool_from_graph_pools_on_one_device() -> None:
    snapshot = [
        {"device": 0, "segment_pool_id": (0, 0), "allocated_size": 100, "total_size": 160},
        {"device": 0, "segment_pool_id": (1, 3), "allocated_size": 40, "total_size": 64},
        {"device": 0, "segment_pool_id": (1, 4), "allocated_size": 8, "total_size": 8},
        {"device": 1, "segment_pool_id": (0, 0), "allocated_size": 999, "total_size": 999},
    ]
    assert pool_usage(snapshot, 0) == {"default": (100.0, 160.0), "graph pools": (48.0, 72.0)}
    assert pool_usage(snapshot, 1) == {"default": (999.0, 999.0), "graph pools": (0.0, 0.0)}


def test_tensor_groups_count_a_shared_storage_once_and_rank_by_bytes() -> None:
    big = torch.zeros(1024, 256)  # 1 MiB of float32
    view = big[:10]  # same storage: not counted again
    small = [torch.zeros(16, dtype=torch.bfloat16) for _ in range(3)]
    weight = torch.nn.Parameter(torch.zeros(64, 64))
    rows = tensor_groups(torch.device("cpu"), [big, view, *small, weight, "not a tensor"])
    assert rows[0] == ("tensor float32 (1024, 256)", 1, float(1024 * 256 * 4))
    assert ("parameter float32 (64, 64)", 1, float(64 * 64 * 4)) in rows
    assert ("tensor bfloat16 (16,)", 3, float(3 * 16 * 2)) in rows
    assert len(rows) == 3


def test_the_report_says_plainly_when_there_is_no_device() -> None:
    assert "no device memory report" in live_memory_report(torch.device("cpu"))
