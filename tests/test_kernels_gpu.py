"""GPU tests of the CUDA-IPC exchange. Skipped (and says so) without a CUDA GPU.

Single process (loopback, W virtual ranks on one GPU): every op, every dtype, W = 1..8, random shapes and
uneven (also zero) token counts, against the torch reference, with poisoned buffers so an unwritten byte
shows; CUDA-graph capture and repeated replay (the barrier counters live on the device).

Several processes oversubscribed on one GPU, gloo for the handshake (W = 2, 4, 8): the `ipc` backend's
output is byte-identical to the `dist` backend and to the reference, bf16 and fp8, random shapes and uneven
counts; back-to-back exchanges without host syncs stay correct (no write-after-read race); every rank uses
cuda:0 although its rank number differs. The timeout test: one rank never calls; the others raise
`All2AllTimeoutError` naming it within timeout + 1 s, can still run CUDA work, the instance refuses
further use, and a fresh instance works.
"""

from __future__ import annotations

import json
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible: GPU kernel tests skipped", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def kernels():
    try:
        import ltx_mgpu_kernels
    except ImportError as exc:
        pytest.fail(f"a GPU is visible but ltx_mgpu_kernels is not installed ({exc}): pip install ./kernels")
    assert ltx_mgpu_kernels.AVAILABLE, ltx_mgpu_kernels.IMPORT_ERROR
    return ltx_mgpu_kernels


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: Any = "cuda") -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (every bit pattern, NaNs included: the exchange moves bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for v in shape:
        n *= v
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8).cpu(), b.contiguous().view(-1).view(torch.uint8).cpu())


def test_the_kernel_loads_on_every_visible_gpu(kernels) -> None:
    """The load probe the `ipc` backend asks before it is offered: this build has code for these GPUs."""
    from ltx_mgpu_kernels._loader import extension

    for index in range(torch.cuda.device_count()):
        assert extension().kernel_image_error(index) is None, torch.cuda.get_device_name(index)


# ==== loopback ===========================================================================================


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_loopback_matches_reference(kernels, world: int, dtype: torch.dtype) -> None:
    from ltx_mgpu_kernels import reference as ref

    rng = random.Random(world * 31 + DTYPES.index(dtype))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    max_tokens, max_hidden = 40, 8 * 24
    inst = kernels.LoopbackAll2All(
        world=world, max_tokens_per_rank=max_tokens, hidden_dim=max_hidden, dtype=dtype, device="cuda:0", max_batch=2
    )
    try:
        for trial in range(4):
            b = rng.randint(1, 2)
            hh = rng.randint(1, 3)
            d = rng.choice([3, 8, 24]) if hh * world * 24 <= max_hidden else 8
            h = hh * world
            counts = [rng.randint(0, max_tokens) for _ in range(world)]
            if trial == 0:
                counts[-1] = 0  # a rank with no tokens
            inst.set_rank_tokens(counts)
            xs = [_rand((b, c, h, d), dtype, gen) for c in counts]
            inst.fill_buffers_(0xA5)
            got = inst.send_recv_heads(xs, copy_out=trial % 2 == 0)
            want = ref.send_recv_heads(xs)
            assert all(_same_bytes(g, w_) for g, w_ in zip(got, want, strict=True)), (trial, counts)
            got_copy = [g.clone() for g in got]
            inst.fill_buffers_(0x5A)
            back = inst.gather_heads(got_copy, copy_out=True)
            assert all(_same_bytes(g, x) for g, x in zip(back, xs, strict=True)), (trial, counts)
            s = rng.randint(0, max_tokens)
            zs = [_rand((b, s, hh, d), dtype, gen) for _ in range(world)]
            inst.fill_buffers_(0xA5)
            got = inst.all_gather_heads(zs)
            assert all(_same_bytes(g, w_) for g, w_ in zip(got, ref.all_gather_heads(zs), strict=True)), trial
        inst.synchronize()
    finally:
        inst.destroy()
        inst.destroy()  # idempotent


def test_loopback_rejects_bad_inputs_before_launch(kernels) -> None:
    inst = kernels.LoopbackAll2All(world=2, max_tokens_per_rank=8, hidden_dim=64, dtype=torch.bfloat16)
    try:
        inst.set_rank_tokens([8, 8])
        ok = [torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        with pytest.raises(TypeError, match="dtype"):
            inst.send_recv_heads([t.float() for t in ok])
        with pytest.raises(ValueError, match="contiguous"):
            inst.send_recv_heads([t.transpose(1, 2).contiguous().transpose(1, 2) for t in ok])
        with pytest.raises(ValueError, match="on cpu"):
            inst.send_recv_heads([t.cpu() for t in ok])
        with pytest.raises(ValueError, match="buffer holds"):
            inst.set_rank_tokens([9, 9])
            inst.send_recv_heads([torch.zeros(1, 9, 4, 16, dtype=torch.bfloat16, device="cuda")] * 2)
    finally:
        inst.destroy()
    with pytest.raises(kernels.All2AllError, match="destroyed"):
        inst.send_recv_heads(ok)


def test_loopback_cuda_graph_replays(kernels) -> None:
    from ltx_mgpu_kernels import reference as ref

    world, counts, b, h, d = 4, [16, 9, 16, 3], 1, 8, 64
    inst = kernels.LoopbackAll2All(world=world, max_tokens_per_rank=16, hidden_dim=h * d, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    try:
        inst.set_rank_tokens(counts)
        xs = [_rand((b, c, h, d), torch.bfloat16, gen) for c in counts]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
            inst.gather_heads(inst.send_recv_heads(xs, copy_out=True), copy_out=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mid = inst.send_recv_heads(xs, copy_out=True)
            out = inst.gather_heads(mid, copy_out=True)
        for replay in range(5):  # every replay must pass its barriers (device-side epochs advance)
            fresh = [_rand((b, c, h, d), torch.bfloat16, gen) for c in counts]
            for x, f in zip(xs, fresh, strict=True):
                x.copy_(f)
            graph.replay()
            torch.cuda.synchronize()
            want = ref.send_recv_heads(fresh)
            assert all(_same_bytes(m, w_) for m, w_ in zip(mid, want, strict=True)), replay
            assert all(_same_bytes(o, f) for o, f in zip(out, fresh, strict=True)), replay
        inst.check()
    finally:
        inst.destroy()


# ==== several processes on one GPU (gloo handshake) =========================================================


def _run(world: int, scenario: str, tmp_path: Path, **kw: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # the rendezvous store is bound here before the ranks start, so its port cannot be taken in between
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    port = int(store.port)
    mp.start_processes(_worker, args=(world, port, scenario, str(tmp_path), kw), nprocs=world, start_method="spawn")
    del store
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _worker(rank: int, world: int, port: int, scenario: str, out_dir: str, kw: dict[str, Any]) -> None:
    import torch.distributed as dist

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.cuda.set_device(0)  # every rank on cuda:0: the device never follows the rank number
    try:
        result = {"compare": _scenario_compare, "timeout": _scenario_timeout}[scenario](rank, world, **kw)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _gather_cpu(x: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, (x.cpu().view(-1).view(torch.uint8).numpy().tobytes(), tuple(x.shape)))
    return [torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(x.dtype).view(shape) for raw, shape in objs]


def _scenario_compare(rank: int, world: int, trials: int, burst: int) -> dict[str, Any]:
    import torch.distributed as dist
    from ltx_mgpu_kernels import reference as ref

    from ltx_mgpu.parallel.sp.backends.dist import create_dist_backend
    from ltx_mgpu.parallel.sp.backends.ipc import create_ipc_backend

    checks = 0
    max_tokens, hh_max, d = 24, 2, 64
    t0 = time.monotonic()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kw = dict(group=dist.group.WORLD, max_tokens_per_rank=max_tokens, hidden_dim=hh_max * world * d, dtype=dtype)
        ipc = create_ipc_backend(**kw, device=torch.device("cuda"), timeout_s=120.0)  # index from the bound device
        dst = create_dist_backend(**kw, device=torch.device("cuda", torch.cuda.current_device()))
        rng = random.Random(1234 + world)  # identical on every rank: shapes and counts agree
        gen = torch.Generator().manual_seed(rank * 1000 + world)  # data differs per rank
        for _ in range(trials):
            hh = rng.randint(1, hh_max)
            counts = [rng.randint(1, max_tokens) for _ in range(world)]
            for b in (ipc, dst):
                b.set_rank_tokens(counts)
            x = _rand((1, counts[rank], hh * world, d), dtype, gen)
            xs = _gather_cpu(x)
            a, bb = ipc.send_recv_heads(x), dst.send_recv_heads(x)
            want = ref.send_recv_heads(xs)[rank]
            assert _same_bytes(a, bb) and _same_bytes(a, want), ("send_recv_heads", rank, counts)
            back_ipc, back_dist = ipc.gather_heads(a), dst.gather_heads(a)
            assert _same_bytes(back_ipc, back_dist) and _same_bytes(back_ipc, x), ("gather_heads", rank, counts)
            z = _rand((1, rng.randint(1, max_tokens), hh, d), dtype, gen)
            zs = _gather_cpu(z)
            g_ipc, g_dist = ipc.all_gather_heads(z), dst.all_gather_heads(z)
            assert _same_bytes(g_ipc, g_dist) and _same_bytes(g_ipc, ref.all_gather_heads(zs)[rank]), "all_gather"
            checks += 3
        # Back-to-back exchanges with no host sync in between: a fast rank must never overwrite a buffer a
        # slow rank has not copied out yet (the entry handshake orders it).
        counts = [max_tokens - r for r in range(world)]
        ipc.set_rank_tokens(counts)
        inputs = [_rand((1, counts[rank], world, d), dtype, gen) for _ in range(burst)]
        outputs = [ipc.send_recv_heads(x) for x in inputs]
        ipc.synchronize()
        for x, out in zip(inputs, outputs, strict=True):
            assert _same_bytes(out, ref.send_recv_heads(_gather_cpu(x))[rank]), ("burst", rank)
            checks += 1
        ipc.destroy()
        ipc.destroy()
        dst.destroy()
    return {"rank": rank, "checks": checks, "seconds": time.monotonic() - t0}


def _scenario_timeout(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    import torch.distributed as dist
    from ltx_mgpu_kernels import All2AllError, All2AllTimeoutError, IpcAll2All

    inst = IpcAll2All(
        dist.group.WORLD,
        max_tokens_per_rank=16,
        hidden_dim=world * 64,
        dtype=torch.bfloat16,
        device=torch.device("cuda", 0),
        timeout_s=timeout_s,
    )
    inst.set_rank_tokens([16] * world)
    x = torch.ones(1, 16, world, 64, dtype=torch.bfloat16, device="cuda")
    dist.barrier()
    result: dict[str, Any] = {"rank": rank}
    if rank != 0:  # rank 0 never calls the exchange
        t0 = time.monotonic()
        inst.send_recv_heads(x)
        try:
            inst.synchronize()
            raise AssertionError("the exchange completed although rank 0 never called it")
        except All2AllTimeoutError as exc:
            result.update(elapsed=time.monotonic() - t0, missing=exc.missing_rank, message=str(exc))
        # The CUDA context is healthy: ordinary work still runs.
        y = torch.arange(1000, device="cuda", dtype=torch.float32)
        result["cuda_ok"] = float((y * 2).sum().item()) == 999000.0
        t1 = time.monotonic()
        try:
            inst.send_recv_heads(x)
            result["refused"] = False
        except All2AllError:
            result["refused"] = True
        result["refuse_s"] = time.monotonic() - t1
    dist.barrier()
    inst.destroy()
    inst.destroy()
    # A new instance over the same ranks works (rank 0 included).
    fresh = IpcAll2All(
        dist.group.WORLD,
        max_tokens_per_rank=16,
        hidden_dim=world * 64,
        dtype=torch.bfloat16,
        device=torch.device("cuda", 0),
        timeout_s=60.0,
    )
    fresh.set_rank_tokens([16] * world)
    out = fresh.send_recv_heads(torch.full((1, 16, world, 64), float(rank), dtype=torch.bfloat16, device="cuda"))
    fresh.synchronize()
    want = torch.arange(world, dtype=torch.bfloat16).repeat_interleave(16).view(1, world * 16, 1, 1)
    result["fresh_ok"] = bool(torch.equal(out.cpu(), want.expand(1, world * 16, 1, 64)))
    fresh.destroy()
    return result


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ipc_matches_dist_backend_oversubscribed(kernels, world: int, tmp_path: Path) -> None:
    trials, burst = (3, 6) if world < 8 else (2, 4)
    results = _run(world, "compare", tmp_path, trials=trials, burst=burst)
    assert [r["checks"] for r in results] == [2 * (3 * trials + burst)] * world
    print(f"world {world}: {results[0]['checks']} checks per rank in {max(r['seconds'] for r in results):.1f} s")


@pytest.mark.parametrize("world", [2, 4])
def test_barrier_timeout_raises_without_poisoning_cuda(kernels, world: int, tmp_path: Path) -> None:
    timeout_s = 2.0
    results = _run(world, "timeout", tmp_path, timeout_s=timeout_s)
    for r in results[1:]:
        assert r["missing"] == 0, r
        assert "rank 0 never arrived" in r["message"], r
        assert r["elapsed"] <= timeout_s + 1.0, r
        assert r["cuda_ok"] and r["refused"] and r["refuse_s"] < 0.5, r
        print(f"rank {r['rank']}: raised after {r['elapsed']:.2f} s: {r['message'][:80]}")
    assert all(r["fresh_ok"] for r in results), results
