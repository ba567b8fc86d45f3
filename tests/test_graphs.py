"""`CudaGraphForward` on CPU.

1. The real wrapper on CPU tensors is a transparent pass-through: same outputs, bit for bit, every call
   eager ("not CUDA"), nothing captured.
2. Its bookkeeping (keys, static buffers, copy-in, output cloning, failure fallback, agreement, eviction)
   is checked with a stand-in backend that "captures" a forward by recording it and "replays" it by
   running it again on the static buffers and writing into the captured output tensors: the semantics of
   a CUDA graph (fixed input and output memory), without CUDA. The forward is the tiny LTX-2 transformer
   behind the SP wrapper, so the capture path (hoisting caches bypassed) runs for real.

The CUDA graphs themselves are tested on a GPU: tests/test_graphs_gpu.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch

from ltx_mgpu.parallel.graphs.capture_cache import capturing
from ltx_mgpu.parallel.graphs.cuda_graph import CudaGraphBackend, CudaGraphForward

from .test_graph_ready import BATCH, HEADS


@pytest.fixture(scope="module")
def x0() -> Any:
    from ltx_core.model.transformer import X0Model
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    from ltx_mgpu.parallel import AttentionManager, SequenceParallelModelWrapper, patch_sp_attention
    from ltx_mgpu.runners.smoke.checkpoint import tiny_transformer_config

    torch.manual_seed(0)
    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS)
    model = LTXModelConfigurator.from_config(cfg).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    mgr = AttentionManager(4096, HEADS, 8, torch.float32, None, backend="dist", local=True)
    patch_sp_attention(model.eval(), mgr)
    return X0Model(SequenceParallelModelWrapper(model, mgr)), cfg["transformer"]


def _inputs(t: dict[str, Any], seed: int, tokens: int = 6, perturbed: bool = False) -> tuple:
    from ltx_core.guidance.perturbations import (
        BatchedPerturbationConfig,
        Perturbation,
        PerturbationConfig,
        PerturbationType,
    )
    from ltx_core.model.transformer.modality import Modality

    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(3 * tokens * 2, dtype=torch.float32).reshape(1, 3, tokens, 2) / 3
    audio_positions = torch.arange(4 * 2, dtype=torch.float32).reshape(1, 1, 4, 2) / 2

    def modality(n: int, channels: int, pos: torch.Tensor) -> Modality:
        return Modality(
            latent=torch.randn(BATCH, n, channels, generator=g),
            sigma=torch.rand(BATCH, generator=g),
            timesteps=torch.rand(BATCH, n, 1, generator=g),
            positions=pos.expand(BATCH, *pos.shape[1:]),  # shared rows: a broadcast dimension
            context=torch.randn(BATCH, 5, t["caption_channels"], generator=g),
        )

    rows = [PerturbationConfig.empty()] * BATCH
    if perturbed:
        rows = [PerturbationConfig([Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [0])])] * BATCH
    video = modality(tokens, t["in_channels"], positions)
    audio = modality(4, t["audio_in_channels"], audio_positions)
    return video, audio, BatchedPerturbationConfig(rows)


class _Graph:
    def __init__(self) -> None:
        self.thunk: Any = None
        self.outputs: tuple = ()

    def replay(self) -> None:
        fresh = self.thunk()
        for out, new in zip(self.outputs, fresh, strict=True):
            out.copy_(new)


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass


class FakeBackend(CudaGraphBackend):
    """CPU stand-in: `capture` records the forward run inside it; `replay` reruns it into the same outputs."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.current: _Graph | None = None
        self.captures = 0

    def supports(self, device: torch.device) -> bool:
        return True

    def current_stream(self, device: torch.device) -> Any:
        return _Stream()

    def side_stream(self, device: torch.device) -> Any:
        return _Stream()

    def on_stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def new_graph(self) -> Any:
        return _Graph()

    def new_pool(self) -> Any:
        return object()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, stream: Any) -> Any:
        self.captures += 1
        self.current = graph
        try:
            if self.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            yield
        finally:
            self.current = None


class Recording:
    """The forward, registering itself with the backend's graph when run inside a capture."""

    def __init__(self, fn: Any, backend: FakeBackend) -> None:
        self.fn, self.backend = fn, backend
        self.calls = 0
        self.captured_under_scope: list[bool] = []

    def __call__(self, video: Any, audio: Any, perturbations: Any) -> Any:
        self.calls += 1
        out = self.fn(video, audio, perturbations)
        graph = self.backend.current
        if graph is not None:
            self.captured_under_scope.append(capturing())
            graph.thunk = lambda: self.fn(video, audio, perturbations)
            graph.outputs = out
        return out


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# =========================================================================================================
# Tests
# =========================================================================================================


def test_wrapper_is_a_transparent_no_op_on_cpu(x0: Any) -> None:
    model, t = x0
    calls = []

    def fn(*args: Any) -> Any:
        calls.append(1)
        return model(*args)

    graphed = CudaGraphForward(fn)
    with torch.no_grad():
        for seed in range(4):
            inputs = _inputs(t, seed)
            assert _same(graphed(*inputs), model(*inputs))
    assert len(calls) == 4
    assert graphed.stats.eager == 4 and graphed.stats.captured == 0 and graphed.graphs == 0
    assert graphed.last_path == "eager: not CUDA" and graphed.reasons == {"not CUDA": 4}


def test_capture_then_replay_with_new_inputs(x0: Any) -> None:
    model, t = x0
    backend = FakeBackend()
    fn = Recording(model, backend)
    graphed = CudaGraphForward(fn, backend=backend)
    paths, kept = [], []
    with torch.no_grad():
        for seed in range(5):
            inputs = _inputs(t, seed)
            out = graphed(*inputs)
            assert _same(out, model(*inputs)), f"call {seed}: {graphed.last_path}"
            paths.append(graphed.last_path.split(":")[0] + ":" + graphed.last_path.split(":")[1][:9])
            kept.append((out, [o.clone() for o in out]))
    assert [p.split(":")[0] for p in paths] == ["eager", "graph", "graph", "graph", "graph"]
    assert graphed.stats.as_dict() | {"capture_s": 0} == {
        "eager": 1,
        "captured": 1,
        "replayed": 3,
        "failed": 0,
        "capture_s": 0,
    }
    assert fn.captured_under_scope == [True]  # the capture ran with the hoisting caches bypassed
    for out, copy in kept:  # outputs handed out are never overwritten by later replays
        assert _same(out, copy)


def test_keys_separate_shapes_perturbations_broadcast_and_caller_state(x0: Any) -> None:
    model, t = x0
    backend = FakeBackend()
    state = {"layout": "1x1"}
    graphed = CudaGraphForward(Recording(model, backend), backend=backend, key_fn=lambda: state["layout"])
    with torch.no_grad():
        for _ in range(2):
            graphed(*_inputs(t, 0))
        assert backend.captures == 1
        variants = [
            _inputs(t, 1, tokens=8),  # another shape
            _inputs(t, 1, perturbed=True),  # another perturbation set
        ]
        video, audio, pert = _inputs(t, 1)
        variants.append((dataclasses.replace(video, positions=video.positions.contiguous()), audio, pert))
        for inputs in variants:
            assert _same(graphed(*inputs), model(*inputs))
            assert graphed.last_path == "eager: first call of this shape"
        state["layout"] = "2x1"
        graphed(*_inputs(t, 2))
        assert graphed.last_path == "eager: first call of this shape"
        state["layout"] = "1x1"
        inputs = _inputs(t, 3)
        assert _same(graphed(*inputs), model(*inputs)) and graphed.last_path == "graph: replay"


def test_capture_failure_falls_back_to_eager(x0: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, t = x0
    backend = FakeBackend(fail=True)
    graphed = CudaGraphForward(Recording(model, backend), backend=backend)
    with torch.no_grad(), caplog.at_level("WARNING", logger="ltx_mgpu.parallel.graphs"):
        results = []
        for seed in range(4):
            inputs = _inputs(t, seed)
            results.append(_same(graphed(*inputs), model(*inputs)))
    assert all(results)
    assert graphed.stats.failed == 1 and graphed.stats.captured == 0 and backend.captures == 1
    assert graphed.last_path.startswith("eager: capture failed earlier: RuntimeError: operation not permitted")
    assert "CUDA graph capture failed" in caplog.text


def test_ranks_that_disagree_stay_eager(x0: Any) -> None:
    model, t = x0
    backend = FakeBackend()
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return False  # another rank could not capture

    graphed = CudaGraphForward(Recording(model, backend), backend=backend, agree=agree)
    with torch.no_grad():
        for seed in range(3):
            inputs = _inputs(t, seed)
            assert _same(graphed(*inputs), model(*inputs))
    assert votes == [True] and graphed.graphs == 0
    assert graphed.last_path == "eager: capture failed earlier: another rank could not capture this forward"


def test_least_recently_used_graph_is_dropped(x0: Any) -> None:
    model, t = x0
    backend = FakeBackend()
    graphed = CudaGraphForward(Recording(model, backend), backend=backend, max_graphs=1)
    with torch.no_grad():
        for tokens in (6, 6, 8, 8):
            graphed(*_inputs(t, 0, tokens=tokens))
        assert graphed.graphs == 1 and backend.captures == 2
        inputs = _inputs(t, 5, tokens=6)  # its graph was dropped: counted again from the start
        assert _same(graphed(*inputs), model(*inputs)) and graphed.last_path == "eager: first call of this shape"


def test_disabled_and_invalid_settings(x0: Any) -> None:
    model, t = x0
    graphed = CudaGraphForward(model, enabled=False, backend=FakeBackend())
    with torch.no_grad():
        graphed(*_inputs(t, 0))
    assert graphed.last_path == "eager: graphs disabled"
    blocked = CudaGraphForward(model, backend=FakeBackend(), capturable=lambda: "SP group is gloo")
    with torch.no_grad():
        blocked(*_inputs(t, 0))
    assert blocked.last_path == "eager: SP group is gloo"
    with pytest.raises(ValueError, match="capture_after"):
        CudaGraphForward(model, capture_after=1)


def test_a_forward_over_the_capture_bound_stays_eager_and_a_smaller_one_captures(x0: Any) -> None:
    """`max_capture_rows` bounds batch x tokens as the wrapper sees them: BATCH x 8 is over a bound of
    BATCH x 6, so that shape never captures (however often it comes), while BATCH x 6 captures on its second call."""
    model, t = x0
    backend = FakeBackend()
    graphed = CudaGraphForward(Recording(model, backend), backend=backend, max_capture_rows=BATCH * 6)
    with torch.no_grad():
        for seed in range(3):
            inputs = _inputs(t, seed, tokens=8)
            assert _same(graphed(*inputs), model(*inputs))
            assert graphed.last_path == f"eager: over {BATCH * 6} token-rows: launches are hidden, a pool would not be"
        assert backend.captures == 0
        for seed in range(2):
            graphed(*_inputs(t, seed, tokens=6))
        assert backend.captures == 1 and graphed.graphs == 1
