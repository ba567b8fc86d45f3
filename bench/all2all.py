"""Benchmark of the CUDA-IPC head exchange: `--mode loopback` (default: W ranks' buffers on one GPU, one
process) or `--mode cross` (one process per GPU over NVLink).

Loopback measures, at the LTX-2 sequence-parallel message sizes (6k, 24k and 32k video tokens in total,
4096 hidden = 32 heads x 128, bf16) for W = 2, 4, 8:
- `send_recv_heads` and `gather_heads` (zero-copy outputs: the kernel alone) and `send_recv_heads` with
  copy-out (what the `ipc` backend returns), timed with CUDA events over replays of a CUDA graph holding
  10 back-to-back calls (so host launch cost does not hide the kernel), median of 5;
- the bytes one exchange moves (every token row leaves its rank once: T x hidden x itemsize) divided by
  the time, as GB/s (1e9 bytes/s, each byte counted once, like the copy below);
- the ratio to a torch device-to-device copy (`dst.copy_(src)`) of the same number of bytes, timed in the
  same run the same way. On one GPU both read and write HBM once per byte, so 1.0 is the ceiling;
- CUDA-graph replay of `send_recv_heads` against eager launches (the eager path includes the Python
  validation and launch cost, which is what graph capture removes).
Each measurement is one JSON line on stdout (and in --out); the last line is `SUMMARY {...}`.

Loopback measures the kernel's efficiency only. `--mode cross` (needs `--worlds` GPUs, default 2) runs one
rank per GPU in one NCCL process group and times, in the same run and on the same bytes, per total token
count: `send_recv_heads` of the `ipc` kernel (zero-copy views and with copy-out), the `dist` backend
(NCCL `all_to_all_single` plus the head permutes around it), a bare `torch.distributed.all_to_all_single`
of the same bytes, and the link's P2P copy rate (a device-to-device copy of the bytes one rank sends to a
peer, one way and all ranks at once). Times are per call, back-to-back eager launches (mean of `--iters`,
the slowest rank, median of 5); outputs are checked byte-equal to the `dist` backend first. GB/s counts the
bytes that leave one rank: (W-1)/W of its shard.

    python -m bench.all2all --out $OUT/bench.jsonl          # loopback, one GPU
    python -m bench.all2all --mode cross --out $OUT/all2all-cross.jsonl   # two GPUs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from bench.common import emit, emit_summary


def _time_ms(fn: Callable[[], Any], iters: int, warmup: int, repeats: int = 5, *, across_ranks: bool = False) -> float:
    """Median over `repeats` of the mean time per call of `iters` back-to-back calls (CUDA events).

    `across_ranks`: every rank of the default process group runs this at once; each sample starts after a
    barrier and is the slowest rank's time (an exchange is done when its last rank is)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if across_ranks:
            torch.cuda.synchronize()
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        sample = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
        if across_ranks:
            dist.all_reduce(sample, op=dist.ReduceOp.MAX)
        samples.append(float(sample.item()))
    return statistics.median(samples)


def _graph_of(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` consecutive fn() (warmed up once on a side stream, as torch recommends)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _kernel_ms(fn: Callable[[], Any], args: argparse.Namespace, calls: int = 10) -> float:
    """Time per call with launch gaps removed: replays of a graph holding `calls` back-to-back calls."""
    graph = _graph_of(fn, calls)
    ms = _time_ms(graph.replay, max(1, args.iters // 2), args.warmup) / calls
    del graph
    return ms


def _emit(rows: list[dict[str, Any]], out: Any, **row: Any) -> None:
    rows.append(row)
    emit(row, out)


def _measure(
    world: int, total: int, args: argparse.Namespace, dev: torch.device, rows: list[dict[str, Any]], out: Any
) -> None:
    """Bandwidth rows (per grid size and op) and one graph-vs-eager row for one (world, total tokens)."""
    from ltx_mgpu_kernels import LoopbackAll2All

    dtype = torch.bfloat16
    heads = args.hidden // args.head_dim
    per_rank = total // world
    nbytes = world * per_rank * args.hidden * 2
    inst = LoopbackAll2All(world=world, max_tokens_per_rank=per_rank, hidden_dim=args.hidden, dtype=dtype, device=dev)
    inst.set_rank_tokens([per_rank] * world)
    xs = [torch.randn(1, per_rank, heads, args.head_dim, device=dev, dtype=dtype) for _ in range(world)]
    ys = inst.send_recv_heads(xs, copy_out=True)
    src = torch.randn(nbytes // 2, device=dev, dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = _kernel_ms(lambda: dst.copy_(src), args)
    copy_gbs = nbytes / copy_ms / 1e6
    common = dict(world=world, tokens=total, hidden=args.hidden, bytes=nbytes, copy_gbps=round(copy_gbs, 1))
    best: dict[str, Any] | None = None
    for blocks in sorted({inst.blocks_per_rank, inst.max_blocks_per_rank}):
        inst.set_blocks_per_rank(blocks)
        for op, fn in (
            ("send_recv_heads", lambda: inst.send_recv_heads(xs)),
            ("gather_heads", lambda: inst.gather_heads(ys)),
            ("send_recv_heads+copy_out", lambda: inst.send_recv_heads(xs, copy_out=True)),
        ):
            ms = _kernel_ms(fn, args)
            gbs = nbytes / ms / 1e6
            row = dict(
                kind="bandwidth",
                op=op,
                blocks_per_rank=blocks,
                ms=round(ms, 4),
                gbps=round(gbs, 1),
                ratio_to_copy=round(gbs / copy_gbs, 3),
                **common,
            )
            _emit(rows, out, **row)
            if op == "send_recv_heads" and (best is None or gbs > best["gbps"]):
                best = row
    if best is None:
        raise RuntimeError("no bandwidth measured")
    inst.set_blocks_per_rank(best["blocks_per_rank"])
    # Graph replay (one call per graph) vs eager launch of the same send_recv_heads (zero-copy output).
    graph = _graph_of(lambda: inst.send_recv_heads(xs), 1)
    graph_ms = _time_ms(graph.replay, args.iters, args.warmup)
    eager_ms = _time_ms(lambda: inst.send_recv_heads(xs), args.iters, args.warmup)
    _emit(
        rows,
        out,
        kind="graph_vs_eager",
        op="send_recv_heads",
        blocks_per_rank=best["blocks_per_rank"],
        graph_ms=round(graph_ms, 4),
        eager_ms=round(eager_ms, 4),
        graph_gbps=round(nbytes / graph_ms / 1e6, 1),
        eager_gbps=round(nbytes / eager_ms / 1e6, 1),
        speedup=round(eager_ms / graph_ms, 3),
        **common,
    )
    inst.check()
    del graph
    inst.destroy()
    torch.cuda.empty_cache()


# ==== cross: one rank per GPU ===============================================================================


def _cross_rank(ctx: Any, totals: list[int], hidden: int, head_dim: int, iters: int, warmup: int) -> list[dict]:
    """Runs on every rank (one GPU each): every size in turn."""
    rows = [_cross_size(ctx, total, hidden, head_dim, iters, warmup) for total in totals]
    torch.cuda.empty_cache()
    return rows


def _cross_size(ctx: Any, total: int, hidden: int, head_dim: int, iters: int, warmup: int) -> dict[str, Any]:
    """One total token count: the exchanges (checked byte-equal first), then the P2P copy of the same bytes."""
    import torch.distributed as dist

    from ltx_mgpu.parallel.sp.backends.dist import create_dist_backend
    from ltx_mgpu.parallel.sp.backends.ipc import IpcBackend, create_ipc_backend

    dev, w = ctx.device, ctx.world_size
    per = total // w
    kw = dict(group=None, max_tokens_per_rank=per, hidden_dim=hidden, dtype=torch.bfloat16, device=dev)
    ipc = create_ipc_backend(**kw, timeout_s=60.0)
    zero_copy = IpcBackend(ipc.instance, zero_copy=True)
    dst = create_dist_backend(**kw)
    for backend in (ipc, dst):
        backend.set_rank_tokens([per] * w)
    x = torch.randn(1, per, hidden // head_dim, head_dim, device=dev, dtype=torch.bfloat16)
    same = torch.equal(ipc.send_recv_heads(x).view(torch.int16), dst.send_recv_heads(x).view(torch.int16))
    flat_in = x.reshape(-1)  # the same bytes as bf16 (NCCL has no 16-bit integer type)
    flat_out = torch.empty_like(flat_in)
    ops = {
        "ipc_zero_copy": lambda: zero_copy.send_recv_heads(x),
        "ipc": lambda: ipc.send_recv_heads(x),
        "dist_backend": lambda: dst.send_recv_heads(x),
        "nccl_all_to_all_single": lambda: dist.all_to_all_single(flat_out, flat_in),
    }
    times = {name: _time_ms(fn, iters, warmup, across_ranks=True) for name, fn in ops.items()}
    ipc.synchronize()
    ipc.destroy()
    dst.destroy()
    sent = per * hidden * 2 * (w - 1) // w  # bytes leaving this rank per exchange
    peer = torch.device("cuda", (torch.cuda.current_device() + 1) % torch.cuda.device_count())
    src = torch.empty(sent, dtype=torch.uint8, device=dev)
    far = torch.empty(sent, dtype=torch.uint8, device=peer)  # (a context on the peer GPU: a benchmark's cost)
    times["p2p_copy_all_ranks"] = _time_ms(lambda: far.copy_(src, non_blocking=True), iters, warmup, across_ranks=True)
    times["p2p_copy_one_way"] = _time_ms(
        lambda: far.copy_(src, non_blocking=True) if ctx.rank == 0 else None, iters, warmup, across_ranks=True
    )
    return {"tokens": total, "bytes_sent_per_rank": sent, "ipc_equals_dist": same, **times}


def _cross(args: argparse.Namespace, out: Any) -> int:
    from ltx_mgpu.parallel.testing import LocalWorld

    world = int(args.worlds.split(",")[0]) if args.worlds != "2,4,8" else 2
    if torch.cuda.device_count() < world:
        emit_summary({"mode": "cross", "error": f"needs {world} GPUs, found {torch.cuda.device_count()}"})
        return 2
    totals = [int(t) for t in args.tokens.split(",")]
    rows: list[dict[str, Any]] = []
    with LocalWorld(world, devices=[f"cuda:{i}" for i in range(world)], backend="nccl", timeout=600) as pool:
        per_rank = pool.run(_cross_rank, totals, args.hidden, args.head_dim, args.iters, args.warmup)
    for row in per_rank[0]:  # times are already the slowest rank's; rank 0 reports them
        gbps = {k.removesuffix("_ms"): round(row["bytes_sent_per_rank"] / v / 1e6, 1)
                for k, v in row.items() if isinstance(v, float)}  # fmt: skip
        _emit(rows, out, kind="cross", world=world, hidden=args.hidden, **{
            k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, gbps=gbps)  # fmt: skip
    summary = {
        "mode": "cross",
        "world": world,
        "ipc_equals_dist": all(r["ipc_equals_dist"] for r in rows),
        "ipc_vs_nccl_a2a": {r["tokens"]: round(r["nccl_all_to_all_single"] / r["ipc"], 3) for r in rows},
        "ipc_zero_copy_vs_nccl_a2a": {
            r["tokens"]: round(r["nccl_all_to_all_single"] / r["ipc_zero_copy"], 3) for r in rows
        },
        "ipc_vs_dist_backend": {r["tokens"]: round(r["dist_backend"] / r["ipc"], 3) for r in rows},
        "ipc_link_efficiency": {r["tokens"]: round(r["p2p_copy_all_ranks"] / r["ipc_zero_copy"], 3) for r in rows},
        "p2p_gbps_one_way": {r["tokens"]: r["gbps"]["p2p_copy_one_way"] for r in rows},
        "p2p_gbps_all_ranks": {r["tokens"]: r["gbps"]["p2p_copy_all_ranks"] for r in rows},
    }
    emit_summary(summary, out)
    return 0 if summary["ipc_equals_dist"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("loopback", "cross"), default="loopback")
    ap.add_argument("--worlds", default="2,4,8", help="loopback: world sizes; cross: GPUs (default 2)")
    ap.add_argument("--tokens", default="6144,24576,32768", help="total video tokens over all ranks")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        emit_summary({"error": "no CUDA device"})
        return 2
    if args.mode == "cross":
        out = open(args.out, "w") if args.out else None
        try:
            return _cross(args, out)
        finally:
            if out is not None:
                out.close()
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    out = open(args.out, "w") if args.out else None
    rows: list[dict[str, Any]] = []
    _emit(rows, out, kind="device", name=props.name, sms=props.multi_processor_count, torch=torch.__version__)

    for world in [int(w) for w in args.worlds.split(",")]:
        for total in [int(t) for t in args.tokens.split(",")]:
            _measure(world, total, args, dev, rows, out)

    bw = [r for r in rows if r["kind"] == "bandwidth" and r["op"] == "send_recv_heads"]
    best_rows: dict[tuple[int, int], dict[str, Any]] = {}
    for r in bw:
        key = (r["world"], r["tokens"])
        if key not in best_rows or r["gbps"] > best_rows[key]["gbps"]:
            best_rows[key] = r
    ge = {(r["world"], r["tokens"]): r for r in rows if r["kind"] == "graph_vs_eager"}
    print("\n world  tokens  blocks/rank  send_recv GB/s  copy GB/s  ratio  graph ms  eager ms", file=sys.stderr)
    for (w, t), r in sorted(best_rows.items()):
        g = ge[(w, t)]
        print(
            f" {w:5d}  {t:6d}  {r['blocks_per_rank']:11d}  {r['gbps']:14.1f}  {r['copy_gbps']:9.1f}  "
            f"{r['ratio_to_copy']:5.3f}  {g['graph_ms']:8.4f}  {g['eager_ms']:8.4f}",
            file=sys.stderr,
        )
    summary = {
        "device": rows[0]["name"],
        "min_ratio_to_copy": min(r["ratio_to_copy"] for r in best_rows.values()),
        "ratios": {f"w{w}_t{t}": r["ratio_to_copy"] for (w, t), r in sorted(best_rows.items())},
        "graph_speedup": {f"w{w}_t{t}": g["speedup"] for (w, t), g in sorted(ge.items())},
        "target_ratio": 0.8,
    }
    summary["meets_target"] = summary["min_ratio_to_copy"] >= 0.8
    emit_summary(summary, out)
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
