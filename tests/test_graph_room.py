"""`GraphRoom`: which request sizes' CUDA graphs a fleet keeps between jobs (unit; the pools are the plan's figures).

The case that made it: on one H100, fp8 distilled 768x512x121 and then 1536x1024x241 on one fleet; the second job's
plan counted only its own pools while 768x512x121's (and more) were still held, and it ran out of memory
(docs/memory.md, "Per card")."""

from __future__ import annotations

from ltx_mgpu.runners.common.graph_room import GraphRoom
from ltx_mgpu.spec.memory_plan import FleetMemory, plan

SMALL, LARGE = (768, 512, 121, 24.0), (1536, 1024, 241, 24.0)


def test_other_sizes_are_dropped_when_their_pools_exceed_the_room_the_plan_leaves() -> None:
    room = GraphRoom()
    assert room.before_job(SMALL, {"graph_pool_gib": 6.0, "graph_room_gib": 8.6}) is False
    assert room.before_job(SMALL, {"graph_pool_gib": 6.0, "graph_room_gib": 0.0}) is False  # its own: planned
    assert room.before_job(LARGE, {"graph_pool_gib": 9.4, "graph_room_gib": 5.9}) is True  # 6.0 held > 5.9
    assert room.held == {LARGE: 9.4}
    assert room.before_job(SMALL, {"graph_pool_gib": 6.0, "graph_room_gib": 9.4}) is False  # 9.4 held fits 9.4
    assert room.held == {LARGE: 9.4, SMALL: 6.0}


def test_no_limit_keeps_every_size_and_a_drop_elsewhere_empties_the_ledger() -> None:
    room = GraphRoom()
    for size in (SMALL, LARGE, SMALL):
        assert room.before_job(size, {"graph_pool_gib": 50.0, "graph_room_gib": None}) is False
        assert room.before_job(size, None) is False
    room.clear()
    assert room.held == {} and room.before_job(LARGE, {"graph_pool_gib": 1.0, "graph_room_gib": 0.0}) is False


def test_plans_for_an_80gb_card_drop_the_small_sizes_graphs_and_every_rank_decides_alike() -> None:
    """Real plans for one 80 GB card (distilled bf16, Gemma resident): 1536x1024x121 leaves less room than
    768x512x121's pools, so they go before it and come back after; two ledgers fed the same plans (two ranks)
    decide the same at every job."""
    fleet = FleetMemory(runner="distilled", world_size=1, capacity_gib=76.9)
    mid = (1536, 1024, 121, 24.0)
    plans = {size: plan(fleet, *size[:3]).job_kwargs() for size in (SMALL, mid)}
    assert plans[SMALL]["graph_pool_gib"] > plans[mid]["graph_room_gib"]
    assert plans[mid]["graph_pool_gib"] <= plans[SMALL]["graph_room_gib"]
    ranks = [GraphRoom(), GraphRoom()]
    decisions = [[r.before_job(s, plans[s]) for r in ranks] for s in (SMALL, mid, mid, SMALL, mid)]
    assert decisions == [[False, False], [True, True], [False, False], [False, False], [True, True]]


def test_the_runner_keeps_the_size_it_dropped_for_in_its_ledger() -> None:
    """`Ltx2Resident._make_graph_room`: after a drop, the job's own size stays in the ledger (it captures in that
    job), so a later size with no room for it drops it in turn; a drop at unpark empties the ledger."""
    from types import SimpleNamespace

    from ltx_mgpu.runners.ltx2.resident import Ltx2Resident

    drops = []
    runner = SimpleNamespace(
        graph_room=GraphRoom(),
        x0_graphed=SimpleNamespace(reset=lambda: drops.append("graphs")),
        clock=SimpleNamespace(release=lambda: drops.append("cache")),
    )
    runner._release_graphs = lambda: Ltx2Resident._release_graphs(runner)
    make = Ltx2Resident._make_graph_room
    make(runner, SMALL, {"graph_pool_gib": 6.0, "graph_room_gib": 9.0})
    make(runner, LARGE, {"graph_pool_gib": 9.4, "graph_room_gib": 5.0})
    assert drops == ["graphs", "cache"] and runner.graph_room.held == {LARGE: 9.4}
    make(runner, SMALL, {"graph_pool_gib": 6.0, "graph_room_gib": 9.0})  # LARGE's 9.4 > 9.0: dropped
    assert drops == ["graphs", "cache"] * 2 and runner.graph_room.held == {SMALL: 6.0}
    Ltx2Resident._drop_graphs(runner)
    assert runner.graph_room.held == {} and len(drops) == 6
