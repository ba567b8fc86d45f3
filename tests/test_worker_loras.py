"""Request LoRAs on the worker side (`worker.render.loras`): the content-named LRU cache, catalogue and S3 sources
(real SeaweedFS), and every refusal ending as a `LoraRefused` naming the entry, before any fleet sees it.
Files are crafted with the byte-level writer of test_lora_file (no torch), against a small target map
standing in for the checkpoint's header, which `transformer_targets` reads (tested there).
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import pytest

from ltx_contract.lora_refs import LoraRef
from worker.ops.metrics import WorkerMetrics
from worker.render.lora_cache import LoraCacheFull
from worker.render.loras import LoraCache, LoraRefused, LoraResolver
from worker.settings import WorkerSettings

from .test_lora_file import TARGETS, lora, write_st


def sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"group": "g", **labels}) or 0.0


@pytest.fixture
def catalogue(tmp_path: Path) -> Path:
    root = tmp_path / "catalogue"
    root.mkdir()
    write_st(root / "dolly.safetensors", lora(rank=4))
    write_st(root / "jib.safetensors", lora(rank=8))
    write_st(root / "cut.safetensors", lora(), cut=3)
    (root / "pickled.safetensors").write_bytes(pickle.dumps({"x": 1}))
    (tmp_path / "outside.safetensors").write_bytes((root / "dolly.safetensors").read_bytes())
    os.symlink(tmp_path / "outside.safetensors", root / "escape.safetensors")
    return root


def resolver(tmp_path: Path, catalogue: Path | None = None, s3=None, **settings) -> LoraResolver:
    s = WorkerSettings(lora_catalogue=catalogue, lora_cache_dir=tmp_path / "cache", **settings)
    r = LoraResolver(s, s3_client=(lambda: s3) if s3 is not None else None, metrics=WorkerMetrics("g"))
    r._targets = dict(TARGETS)  # (what transformer_targets reads from the runner's checkpoint)
    return r


# ==== the cache =============================================================================================


def test_cache_commits_atomically_and_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = LoraCache(tmp_path / "c", cap_bytes=250)
    for i, key in enumerate(("a", "b", "c")):
        with cache.incoming(100) as tmp:
            tmp.write_bytes(bytes(100))
            cache.commit(tmp, key)
            assert not tmp.exists()  # renamed, not copied
        os.utime(cache.path_for(key), (1000 + i, 1000 + i))
        if key == "b":
            assert cache.get("a") is not None  # a use makes "a" the most recent
        cache.release()  # (the job that used them ended)
        assert cache.usage() <= 250  # after every admission, not eventually
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".incoming")]


def test_cache_never_evicts_pinned_files_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    cache = LoraCache(tmp_path / "c", cap_bytes=250)
    for key in ("a", "b"):
        with cache.incoming(100) as tmp:
            tmp.write_bytes(bytes(100))
            cache.commit(tmp, key)  # pinned by this job until release
    with pytest.raises(LoraCacheFull, match="do not fit beside 200 bytes in use under its cap of 250"):
        cache.incoming(100).__enter__()
    assert cache.get("a") and cache.get("b") and cache.usage() == 200  # nothing evicted, nothing over the cap
    with pytest.raises(RuntimeError), cache.incoming(10) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("fetch died")
    assert sorted(p.name for p in cache.root.iterdir() if not p.name.startswith(".lock")) == [
        "a.safetensors", "b.safetensors"
    ]  # fmt: skip
    cache.release()
    with cache.incoming(100) as tmp:  # unpinned now: the least recently used makes room
        tmp.write_bytes(bytes(100))
        cache.commit(tmp, "c")
    assert cache.usage() <= 250 and len(list(cache.root.glob("*.safetensors"))) == 2


# ==== the catalogue ==========================================================================================


def test_catalogue_lora_is_copied_once_by_content_then_hit(tmp_path: Path, catalogue: Path) -> None:
    r = resolver(tmp_path, catalogue)
    first = r.resolve([LoraRef(name="dolly", strength=0.5)])[0]
    assert not first.cached and first.fetch_bytes == (catalogue / "dolly.safetensors").stat().st_size
    assert Path(first.path).parent == tmp_path / "cache" and Path(first.path).name.startswith("sha256-")
    again = r.resolve([LoraRef(name="dolly")])[0]
    assert again.cached and again.path == first.path
    # the header checks are timed apart from the copy (a hit is checked again), and reported with the job
    assert 0 < first.verify_s <= first.fetch_s and again.verify_s > 0 and again.fetch_s == 0
    assert first.summary()["verify_s"] == round(first.verify_s, 4)
    assert sample(r.metrics, "ltx_worker_lora_cache_total", result="miss") == 1
    assert sample(r.metrics, "ltx_worker_lora_cache_total", result="hit") == 1
    assert sample(r.metrics, "ltx_worker_lora_fetch_bytes_total") == first.fetch_bytes
    # replaced under the same name: a new content key, so nothing keyed by the old path can serve it
    write_st(catalogue / "dolly.safetensors", lora(rank=2))
    replaced = r.resolve([LoraRef(name="dolly")])[0]
    assert replaced.path != first.path and not replaced.cached
    assert r.published().names == ("cut", "dolly", "jib", "pickled")  # (not "escape": a symlink out of it)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("crane", "crane: not in the catalogue"),
        ("escape", "escape: not in the catalogue"),  # a symlink out of the folder
        ("cut", "cut: truncated"),
        ("pickled", "pickled: a Python pickle"),
    ],
)
def test_bad_catalogue_entries_are_refused_and_never_cached(tmp_path: Path, catalogue: Path, name, message) -> None:
    r = resolver(tmp_path, catalogue)
    with pytest.raises(LoraRefused, match=f"^loras\\[1\\]: {message}") as info:
        r.resolve([LoraRef(name="jib"), LoraRef(name=name)])
    assert info.value.field == "loras[1]"
    assert str(tmp_path) not in str(info.value)  # the client learns what is wrong, not the worker's paths
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) <= 1  # only the good one (none: refused first)


def test_count_no_catalogue_and_a_runner_without_a_checkpoint(tmp_path: Path, catalogue: Path) -> None:
    with pytest.raises(LoraRefused, match="2 LoRAs; this worker takes at most 1"):
        resolver(tmp_path, catalogue, lora_max_per_request=1).resolve([LoraRef(name="a"), LoraRef(name="b")])
    with pytest.raises(LoraRefused, match="has no LoRA catalogue"):
        resolver(tmp_path).resolve([LoraRef(name="dolly")])
    r = resolver(tmp_path, catalogue, runner="smoke")
    r._targets = None
    with pytest.raises(LoraRefused, match="runner 'smoke' takes no LoRAs"):
        r.resolve([LoraRef(name="dolly")])
    with pytest.raises(LoraRefused, match="rank 8; allowed 1..4"):
        resolver(tmp_path, catalogue, lora_max_rank=4).resolve([LoraRef(name="jib")])


# ==== S3 (SeaweedFS) =========================================================================================


@pytest.fixture
def bucket(s3_client) -> str:
    name = f"loras-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=name)
    return name


def test_s3_lora_is_fetched_once_and_bad_objects_are_refused(tmp_path: Path, s3_client, bucket: str) -> None:
    good = write_st(tmp_path / "good.safetensors", lora()).read_bytes()
    s3_client.put_object(Bucket=bucket, Key="u/good.safetensors", Body=good)
    s3_client.put_object(Bucket=bucket, Key="u/pickle.safetensors", Body=pickle.dumps([1]))
    s3_client.put_object(Bucket=bucket, Key="u/cut.safetensors", Body=good[:-5])
    s3_client.put_object(Bucket=bucket, Key="other/good.safetensors", Body=good)
    r = resolver(tmp_path, s3=s3_client, lora_s3_prefixes=[f"{bucket}/u/"], lora_max_file_bytes=len(good) + 10)
    first = r.resolve([LoraRef(uri=f"s3://{bucket}/u/good.safetensors")])[0]
    assert not first.cached and first.fetch_bytes == len(good) and Path(first.path).read_bytes() == good
    assert 0 < first.verify_s < first.fetch_s  # the check, then the fetch it is part of
    assert r.resolve([LoraRef(uri=f"s3://{bucket}/u/good.safetensors")])[0].cached
    assert sample(r.metrics, "ltx_worker_lora_fetch_bytes_total") == len(good)
    assert r.metrics.registry.get_sample_value("ltx_worker_lora_fetch_seconds_count", {"group": "g"}) == 1
    cases = {
        "u/missing.safetensors": "no such object",
        "u/pickle.safetensors": "a Python pickle",
        "u/cut.safetensors": "truncated",
        "other/good.safetensors": "under no prefix this worker allows",
    }
    for key, message in cases.items():
        with pytest.raises(LoraRefused, match=f"^loras\\[0\\]: .*{message}"):
            r.resolve([LoraRef(uri=f"s3://{bucket}/{key}")])
    s3_client.put_object(Bucket=bucket, Key="u/big.safetensors", Body=good + bytes(64))
    with pytest.raises(LoraRefused, match=r"object is \d+ bytes, over the \d+ byte limit"):
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/big.safetensors")])
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    with pytest.raises(LoraRefused, match="has no S3 client"):
        resolver(tmp_path, lora_s3_prefixes=[bucket]).resolve([LoraRef(uri=f"s3://{bucket}/u/good.safetensors")])


def test_s3_fetch_in_parallel_ranges_reassembles_the_exact_bytes(tmp_path: Path, s3_client, bucket: str,
                                                                   monkeypatch) -> None:  # fmt: skip
    import worker.render.lora_fetch as loras_module

    good = write_st(tmp_path / "good.safetensors", lora(rank=8)).read_bytes()
    s3_client.put_object(Bucket=bucket, Key="u/good.safetensors", Body=good)
    monkeypatch.setattr(loras_module, "_RANGE", 1000)  # several ranges, the last one short
    assert len(good) > 3 * 1000 and len(good) % 1000
    r = resolver(tmp_path, s3=s3_client, lora_s3_prefixes=[f"{bucket}/u/"])
    got = r.resolve([LoraRef(uri=f"s3://{bucket}/u/good.safetensors")])[0]
    assert Path(got.path).read_bytes() == good
