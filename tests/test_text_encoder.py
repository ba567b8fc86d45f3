"""Distributed prompt encoding with the tiny real Gemma 3 + LTX-2 embeddings processor (loaded through the
real loaders from a Hugging Face-style root with a locally built tokenizer): every rank gets identical
embeddings, equal to a single-process encoding; encoder failures are symmetric RunnerErrors.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.errors import RunnerError
from ltx_mgpu.parallel.testing import LocalWorld
from ltx_mgpu.parallel.text_encoder import BatchParallelPromptEncoder, DistributedPromptEncoder

PROMPTS = ["a cat walks along the beach at sunset", "blurry, low quality"]
TOKENS = 128


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()  # the shared cache ($LTX_MGPU_CACHE or ~/.cache/ltx-mgpu): written once


@pytest.fixture(scope="module")
def reference(tiny):
    return local_encoder(tiny).encode(PROMPTS)


def local_encoder(tiny):
    from ltx_mgpu.runners.ltx2.text import build_gemma_prompt_encoder

    return build_gemma_prompt_encoder(
        tiny.gemma_root, str(tiny.checkpoint), device="cpu", dtype=torch.float32, max_tokens=TOKENS,
        enhance_max_new_tokens=8,
    )  # fmt: skip


class Failing:
    def encode(self, prompts):
        raise ValueError(f"cannot tokenize {prompts[0]!r}")

    def enhance(self, prompt, *, image=None, seed=42):
        raise ValueError("no enhancer")


def test_local_encoder_shapes_and_determinism(tiny):
    enc = local_encoder(tiny)
    a = enc.encode(PROMPTS)
    b = enc.encode(PROMPTS[:1])
    assert a[0]["video"].shape == (1, TOKENS, 32) and a[0]["audio"].shape == (1, TOKENS, 32)
    assert a[0]["mask"].dtype == torch.int64
    assert torch.equal(a[0]["video"], b[0]["video"])
    assert not torch.equal(a[0]["video"], a[1]["video"])
    assert enc.enhance("a cat", seed=1) == enc.enhance("a cat", seed=1)


def _rank_source(ctx, tiny, fail):
    import torch.distributed as dist

    encoder = None
    if ctx.rank == 0:
        encoder = Failing() if fail else local_encoder(tiny)
    dpe = DistributedPromptEncoder(encoder, group=dist.group.WORLD, device=ctx.device)
    try:
        return dpe.encode(PROMPTS), dpe.enhance("a dog", seed=5)
    except RunnerError as exc:
        return str(exc)


def _rank_batch_parallel(ctx, tiny):
    import torch.distributed as dist

    bp = BatchParallelPromptEncoder(local_encoder(tiny), group=dist.group.WORLD, device=ctx.device)
    return bp.encode(PROMPTS)


@pytest.fixture(scope="module")
def world():
    with LocalWorld(2) as w:
        yield w


def _assert_same(encodings, reference):
    assert len(encodings) == len(reference)
    for got, want in zip(encodings, reference, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_source_rank_broadcast_gives_every_rank_identical_embeddings(world, tiny, reference):
    (enc0, text0), (enc1, text1) = world.run(_rank_source, tiny, False)
    _assert_same(enc0, reference)
    _assert_same(enc1, reference)
    assert text0 == text1 and isinstance(text0, str)


def test_batch_parallel_gives_every_rank_identical_embeddings(world, tiny, reference):
    for encodings in world.run(_rank_batch_parallel, tiny):
        _assert_same(encodings, reference)


def test_encoder_failure_is_symmetric(world, tiny):
    messages = world.run(_rank_source, tiny, True)
    assert messages[0] == messages[1]
    assert "text encoder failed on rank 0: ValueError: cannot tokenize" in messages[0]
