"""`host_tier.pinned_buffer`'s registration lifetime, on CPU with the CUDA runtime's two calls recorded (unit).

On an H100 the GPU suite failed in tests that came after a pinned buffer was freed: the driver still held its
registration, so a later, unrelated host allocation at the same address was treated as page-locked and copies
from it failed ("invalid argument", "part or all of the requested memory range is already mapped"). The rule
held here: the registration ends once, after the last tensor viewing the bytes is gone and before they are freed.
"""

from __future__ import annotations

import gc
import itertools
import logging

import pytest
import torch

from ltx_mgpu.runners.common import host_tier


class _Cudart:
    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.refuse = refuse

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # (the runtime's names)
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        assert address not in self.registered, "registered twice: the bug this module guards"
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        assert self.registered.pop(address, None) is not None, "unregistering what is not registered"
        self.unregistered.append(address)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = _Cudart()
    monkeypatch.setattr(host_tier, "_pin_ok", lambda device: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_registration_ends_after_the_last_view_and_only_once(cudart):
    buf = host_tier.pinned_buffer(4096 + 3, torch.device("cuda", 0))
    address = buf.data_ptr()
    assert buf.numel() == 4099 and cudart.registered == {address: 4099}
    views = host_tier.pack_pinned([torch.arange(8, dtype=torch.float32)], torch.device("cuda", 0))
    del buf
    gc.collect()
    assert cudart.unregistered == [address]  # the first buffer, gone with its only tensor
    (view,) = views
    packed = view.untyped_storage().data_ptr()
    alias = view[2:5].view(torch.uint8)
    del views, view
    gc.collect()
    assert packed in cudart.registered and alias.sum() >= 0  # a view still reads the bytes: still registered
    del alias
    gc.collect()
    assert cudart.registered == {} and cudart.unregistered == [address, packed]


def test_a_refused_registration_leaves_a_plain_buffer_and_says_so(monkeypatch, caplog):
    fake = _Cudart(refuse=True)
    monkeypatch.setattr(host_tier, "_pin_ok", lambda device: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with caplog.at_level(logging.WARNING, logger="ltx_mgpu.runners.host_tier"):
        buf = host_tier.pinned_buffer(1 << 20, torch.device("cuda", 0))
    assert buf.numel() == 1 << 20 and "could not page-lock" in caplog.text
    del buf
    gc.collect()
    assert fake.unregistered == []  # nothing was registered: nothing to end


def test_a_copy_back_that_finds_no_room_leaves_the_encoder_parked_for_the_next_encode(monkeypatch, caplog):
    """The text encoder's copy back after a job's decode runs while that job's frames are still alive; when it
    runs out of memory the finished video must not be lost: the job goes on, the encoder stays parked, and the
    next encode (`_text_ready`, once the job's tensors are gone) copies it back."""
    import contextlib
    import types

    from ltx_mgpu.runners.ltx2.resident import Ltx2Resident

    module = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in module.parameters()]
    parkable = host_tier.ParkableWeights(module, torch.device("cpu"))
    parkable.park()
    dropped = []
    runner = types.SimpleNamespace(
        park_this_job=True,
        parkable_text=parkable,
        device=torch.device("cpu"),
        clock=types.SimpleNamespace(stage=lambda name: contextlib.nullcontext()),
        _drop_graphs=lambda: dropped.append(True),
    )
    real_unpark = host_tier.ParkableWeights.unpark

    def no_room(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.58 GiB.")

    monkeypatch.setattr(host_tier.ParkableWeights, "unpark", no_room)
    with caplog.at_level(logging.WARNING, logger="ltx_mgpu.runners.ltx2"):
        Ltx2Resident._unpark_text(runner)  # no exception: the job's video is made
    assert dropped == [True] and parkable.parked
    assert "stays parked until the next encode" in caplog.text
    assert "what holds the device: cpu: no device memory report off CUDA" in caplog.text
    monkeypatch.setattr(host_tier.ParkableWeights, "unpark", real_unpark)
    Ltx2Resident._text_ready(runner)
    assert not parkable.parked
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))


class _TwoLayers(torch.nn.Module):
    """Parameters of several sizes, one of them larger than the piece limit the test sets, and one tied pair."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)  # 8 KiB
        self.small = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))  # ~1.1 KiB each
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, one place in the mirror


def test_the_copy_back_comes_in_pieces_no_larger_than_the_limit_and_returns_every_byte(monkeypatch):
    """A copy back in one allocation needs the whole encoder's size free in one piece; the pieces keep every
    allocation at the limit (a larger single parameter alone in its own), cover the mirror exactly once, and the
    parameters come back byte for byte, tied ones still tied."""
    limit = 4096
    monkeypatch.setattr(host_tier, "PIECE_BYTES", limit)
    torch.manual_seed(3)
    module = _TwoLayers()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    parkable = host_tier.ParkableWeights(module, torch.device("cpu"))
    pieces = parkable._pieces
    assert pieces[0][0] == 0 and pieces[-1][1] == parkable.nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # contiguous, no overlap
    sizes = {start: size for start, size in parkable._layout}
    for start, end in pieces:
        alone = start in sizes and host_tier._aligned(sizes[start]) == end - start
        assert end - start <= limit or alone, (start, end)
    assert len(pieces) >= 3 and parkable.describe()["pieces"] == len(pieces)
    for _ in range(2):
        parkable.park()
        parkable.unpark()
        assert module.head.weight is module.embed.weight
        for name, p in module.named_parameters():
            assert torch.equal(p, before[name]), name


def test_two_parameters_over_one_tensor_are_parked_and_brought_back_as_one():
    """What a load that files one tensor under two keys builds (ltx-core's Gemma: the token table and the head,
    two Parameters over the same memory): mirrored once, and after a park and a copy back still one tensor.
    Counted by identity alone (before), a bf16 Gemma's 1.88 GiB table was mirrored twice in pinned memory and came
    back from each park as two device copies (read from the code: the GPU runs never measured it apart)."""
    module = _TwoLayers()
    module.head.weight = torch.nn.Parameter(module.embed.weight.data)  # a second Parameter, the same memory
    table = module.embed.weight.detach().clone()
    parkable = host_tier.ParkableWeights(module, torch.device("cpu"))
    single = host_tier.ParkableWeights(_TwoLayers(), torch.device("cpu"))  # (tied: the table counted once)
    assert parkable.nbytes == single.nbytes
    for _ in range(2):
        parkable.park()
        assert module.head.weight.data_ptr() == module.embed.weight.data_ptr()
        parkable.unpark()
        assert module.head.weight.data_ptr() == module.embed.weight.data_ptr()
        assert module.head.weight is not module.embed.weight and torch.equal(module.head.weight, table)


def test_a_copy_back_that_runs_out_part_way_leaves_the_weights_parked(monkeypatch):
    """Out of memory at the third piece: nothing is half-restored (every parameter still views the mirror) and a
    later copy back, with room, restores them all."""
    monkeypatch.setattr(host_tier, "PIECE_BYTES", 4096)
    module = _TwoLayers()
    parkable = host_tier.ParkableWeights(module, torch.device("cpu"))
    parkable.park()
    mirrored = [p.data_ptr() for p in module.parameters()]
    real_empty, calls = torch.empty, []

    def third_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB.")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", third_fails)
    with pytest.raises(torch.OutOfMemoryError):
        parkable.unpark()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert parkable.parked and [p.data_ptr() for p in module.parameters()] == mirrored
    parkable.unpark()
    assert not parkable.parked and parkable.stats == {"parks": 1, "unparks": 1}


class _Stack(torch.nn.Module):
    """An embedding, a stack of layers and a norm: the shape of a decoder, small."""

    def __init__(self, layers: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
        return self.norm(h)


def test_streamed_layers_visit_one_ahead_and_leave_after_their_use():
    """Every forward copies each layer in once, at most two at a time (the one running and the next), and parks
    each after its use; the output is the unstreamed module's, exactly (the same bytes, the same kernels)."""
    torch.manual_seed(5)
    module = _Stack()
    ids = torch.randint(0, 32, (2, 7))
    with torch.inference_mode():
        expected = module(ids)
    assert host_tier.largest_layer_list(module) is module.layers
    streamed = host_tier.StreamedLayers(module.layers, torch.device("cpu"))
    assert streamed.describe()["on_device"] == 0  # parked from the start
    in_flight = []
    probes = [
        layer.register_forward_pre_hook(lambda *_: in_flight.append(streamed.describe()["on_device"]))
        for layer in module.layers
    ]
    with torch.inference_mode():
        for forward in (1, 2):
            assert torch.equal(module(ids), expected)
            assert streamed.stats == {"forwards": forward, "copies": 5 * forward}
            assert streamed.describe()["on_device"] == 0
    assert in_flight == [2, 2, 2, 2, 1] * 2  # (seen as each layer starts: the last has no next one to copy)
    for probe in probes:
        probe.remove()


class _TiedStack(_Stack):
    """`_Stack` with an output head tied to its embeddings (as Gemma's is) and a part its forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.unused = torch.nn.Linear(16, 16)


def test_a_streamed_module_keeps_its_host_parts_on_the_host_and_runs_them_there():
    """`stream_module(..., on_host=)`: the host parts' weights are never copied (on CPU ranks the device copy of
    everything else is a second host tensor, as the stack's is: a new address tells a moved weight from a kept
    one), a head tied to the embedding stays with it, the host parts run through their hooks, and the output is
    the unstreamed module's, exactly. Which way each hook sends its tensors shows only on a GPU
    (`test_placement_gpu.py`, the tiny Gemma streamed)."""
    torch.manual_seed(6)
    module = _TiedStack()
    ids = torch.randint(0, 32, (2, 7))
    with torch.inference_mode():
        expected = module(ids)
    before = {name: p.data_ptr() for name, p in module.named_parameters()}
    streamed = host_tier.stream_module(module, torch.device("cpu"), [module.embed, module.head, module.unused])
    after = {name: p.data_ptr() for name, p in module.named_parameters()}
    kept = {name for name in before if after[name] == before[name]}
    assert kept == {"embed.weight", "unused.weight", "unused.bias"}  # (the head's weight is the embedding's)
    assert module.head.weight is module.embed.weight
    assert all(len(part._forward_pre_hooks) == 1 for part in (module.embed, module.head, module.unused))
    assert streamed.describe()["layers"] == 5 and streamed.describe()["on_device"] == 0
    with torch.inference_mode():
        assert torch.equal(module(ids), expected)
    assert streamed.stats == {"forwards": 1, "copies": 5}


def test_a_weight_shared_with_a_host_part_must_stay_with_it():
    """A tied weight cannot be on the host for one user and on the device for the other: refused, by name."""
    module = _TiedStack()
    with pytest.raises(ValueError, match="Linear shares a weight with a part kept on the host"):
        host_tier.stream_module(module, torch.device("cpu"), [module.embed])
