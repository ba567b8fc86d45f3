"""Distributed prompt encoding with the tiny real Gemma 3 + LTX-2 embeddings processor (loaded through the
real loaders from a Hugging Face-style root with a locally built tokenizer): every rank gets identical
embeddings, equal to a single-process encoding; encoder failures are symmetric RunnerErrors.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.control.errors import RunnerError
from ltx_mgpu.parallel.pipeline.text_encoder import BatchParallelPromptEncoder, DistributedPromptEncoder
from ltx_mgpu.parallel.testing import LocalWorld

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


def test_a_streamed_encoder_gives_the_resident_ones_embeddings(tiny, reference):
    """The `stream` placement: Gemma loads on the host, its layer stack visits the device layer by layer (on
    CPU ranks a second host copy: the bookkeeping), its token table and vision tower stay on the host and run
    there, the rest moves to the device; the embeddings are the resident encoder's, exactly, and every encode
    copies each layer once."""
    from ltx_mgpu.runners.ltx2.text import build_gemma_prompt_encoder

    enc = build_gemma_prompt_encoder(
        tiny.gemma_root, str(tiny.checkpoint), device="cpu", dtype=torch.float32, max_tokens=TOKENS,
        enhance_max_new_tokens=8, stream=True,
    )  # fmt: skip
    layers = enc.streamed.describe()["layers"]
    assert layers >= 2 and enc.streamed.describe()["on_device"] == 0
    gemma = enc.text_encoder.model  # the token table (the head tied to it) and the vision tower run on the host
    assert gemma.get_output_embeddings().weight is gemma.get_input_embeddings().weight  # (one table, even in fp32)
    on_host = (gemma.get_input_embeddings(), gemma.get_output_embeddings(), gemma.model.vision_tower)
    assert all(len(part._forward_pre_hooks) == 1 for part in on_host)
    for first, second in zip(enc.encode(PROMPTS), reference, strict=True):
        for key in ("video", "audio", "mask"):
            assert torch.equal(first[key], second[key]), key
    assert enc.streamed.stats == {"forwards": 1, "copies": layers}


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


# ==== one batched forward, the cached negative prompt, two collectives ================================


def test_batched_forward_matches_one_prompt_at_a_time(tiny):
    """Both prompts through Gemma at once == each alone, up to reduction order: every prompt is padded to
    the same length and masked, so the rows cannot see each other. The bound: fp32 rounding of a sum of K
    products is at most ~K*eps relative to the magnitudes; 8*eps*K_max times the output's scale (K_max: the
    widest reduction in the encoder, its MLP's intermediate size) is far below any real difference."""
    enc = local_encoder(tiny)
    batched = enc.encode(PROMPTS)
    alone = [enc.encode([p])[0] for p in PROMPTS]
    config = enc.text_encoder.model.config.get_text_config()
    k_max = max(int(config.hidden_size), int(config.intermediate_size), TOKENS)
    for got, want in zip(batched, alone, strict=True):
        assert torch.equal(got["mask"], want["mask"])
        for key in ("video", "audio"):
            scale = float(want[key].abs().max())
            tol = 8 * torch.finfo(torch.float32).eps * k_max * scale
            assert float((got[key] - want[key]).abs().max()) <= tol, key
    # and the rows really differ (the bound is not vacuous): the two prompts' embeddings are far apart
    assert float((batched[0]["video"] - batched[1]["video"]).abs().max()) > 1000 * tol


class Counting:
    """A local encoder that records the prompts it is asked for (and has an identity that can change)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[list[str]] = []
        self.identity = "weights-a"

    def encode(self, prompts):
        self.calls.append(list(prompts))
        return self.inner.encode(prompts)

    def enhance(self, prompt, *, image=None, seed=42):
        return prompt


def _rank_cached(ctx, tiny):
    import torch.distributed as dist

    counting = Counting(local_encoder(tiny)) if ctx.rank == 0 else None
    dpe = DistributedPromptEncoder(counting, group=dist.group.WORLD, device=ctx.device)
    calls = {"object": 0, "tensor": 0}
    real_obj, real_tensor = dist.broadcast_object_list, dist.broadcast

    def count(kind, real):
        def wrapped(*a, **kw):
            calls[kind] += 1
            return real(*a, **kw)

        return wrapped

    dist.broadcast_object_list, dist.broadcast = count("object", real_obj), count("tensor", real_tensor)
    try:
        first = dpe.encode(PROMPTS, cacheable=(False, True))
        per_job = dict(calls)
        second = dpe.encode(["a dog runs", PROMPTS[1]], cacheable=(False, True))
        if counting is not None:
            counting.identity = "weights-b"  # the encoder changed: the cached negative must go
        third = dpe.encode(PROMPTS, cacheable=(False, True))
    finally:
        dist.broadcast_object_list, dist.broadcast = real_obj, real_tensor
    return {
        "first": first, "second": second, "third": third, "per_job": per_job,
        "calls": None if counting is None else counting.calls, "hits": dpe.cache.hits,
    }  # fmt: skip


@pytest.mark.parametrize("size", [1, 2])
def test_negative_prompt_is_cached_per_worker_and_dropped_when_the_encoder_changes(tiny, reference, size, world):
    if size == 1:
        with LocalWorld(1) as one:
            results = one.run(_rank_cached, tiny)
    else:
        results = world.run(_rank_cached, tiny)
    for r in results:
        _assert_same(r["first"], reference)
        _assert_same(r["third"], reference)
        assert torch.equal(r["second"][1]["video"], reference[1]["video"])  # from the cache, bit for bit
        assert r["hits"] == 1
    calls = results[0]["calls"]
    # the negative is encoded once, skipped while cached, encoded again under the new identity
    assert calls == [PROMPTS, ["a dog runs"], PROMPTS]
    if size == 2:  # one object broadcast + one tensor broadcast per encode, whatever the tensor count
        assert all(r["per_job"] == {"object": 1, "tensor": 1} for r in results)
