"""`host_tier.pinned_buffer`'s registration lifetime, on CPU with the CUDA runtime's two calls recorded (unit).

On an H100 the GPU suite failed in tests that came after a pinned buffer was freed: the driver still held its
registration, so a later, unrelated host allocation at the same address was treated as page-locked and copies
from it failed ("invalid argument", "part or all of the requested memory range is already mapped"). The rule
held here: the registration ends once, after the last tensor viewing the bytes is gone and before they are freed.
"""

from __future__ import annotations

import gc
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
    monkeypatch.setattr(host_tier.ParkableWeights, "unpark", real_unpark)
    Ltx2Resident._text_ready(runner)
    assert not parkable.parked
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
