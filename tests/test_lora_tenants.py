"""Request LoRAs against a hostile tenant, real S3 (SeaweedFS): a uri outside the
tenant's folder is refused by one rule at submit and in the worker, in the same words whether the object exists;
the cache tells one tenant nothing of another's objects; an object's header is checked from a ranged GET before
its body is fetched; a header nested 200,000 deep is a request error; the strengths of one file add up."""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ltx_contract.health import LoraOffer
from ltx_contract.lora_refs import LoraRef, uri_problem
from ltx_contract.schema import RenderRequest
from ltx_mgpu.lora_file import LoraFileError, check_lora
from producer.loras import lora_problems
from worker.ops.metrics import WorkerMetrics
from worker.render.loras import LoraRefused, LoraResolver
from worker.settings import WorkerSettings

from .test_lora_file import TARGETS, lora, write_st


@pytest.fixture
def bucket(s3_client: Any) -> str:
    name = f"loras-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=name)
    return name


class Counting:
    """The worker's S3 client, counting the body bytes its GETs return (what a fetch cost)."""

    def __init__(self, client: Any) -> None:
        self.client, self.got = client, 0

    def get_object(self, **kwargs: Any) -> Any:
        out = self.client.get_object(**kwargs)
        self.got += int(out["ContentLength"])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def resolver(tmp_path: Path, s3: Any, **settings: Any) -> LoraResolver:
    s = WorkerSettings(lora_cache_dir=tmp_path / "cache", **settings)
    r = LoraResolver(s, s3_client=lambda: s3, metrics=WorkerMetrics("g"))
    r._targets = dict(TARGETS)
    return r


# ==== 10: per-tenant prefixes, no cross-tenant oracle ====================================================


def test_a_tenant_reads_only_its_own_folder_or_a_shared_one(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    good = write_st(tmp_path / "g.safetensors", lora()).read_bytes()
    for key in ("loras/bob/style.safetensors", "loras/alice/mine.safetensors", "shared/house.safetensors"):
        s3_client.put_object(Bucket=bucket, Key=key, Body=good)
    r = resolver(tmp_path, s3_client, lora_s3_prefixes=[f"{bucket}/loras"], lora_shared_prefixes=[f"{bucket}/shared/"],
                 tenant_ids=True)  # fmt: skip
    refused = []
    for key in ("loras/bob/style.safetensors", "loras/bob/missing.safetensors"):  # exists, and does not
        with pytest.raises(LoraRefused) as info:
            r.resolve([LoraRef(uri=f"s3://{bucket}/{key}")], tenant="alice")
        refused.append(str(info.value).replace(key, "KEY"))
    assert refused[0] == refused[1] and "not under tenant 'alice'" in refused[0], refused  # no existence oracle
    assert r.metrics.registry.get_sample_value("ltx_worker_lora_fetch_bytes_total", {"group": "g"}) is None
    mine = r.resolve([LoraRef(uri=f"s3://{bucket}/loras/alice/mine.safetensors")], tenant="alice")[0]
    assert not mine.cached
    house = f"s3://{bucket}/shared/house.safetensors"
    assert not r.resolve([LoraRef(uri=house)], tenant="bob")[0].cached
    # bob used it just now; alice's first use is still a miss: the cache tells no tenant what another used
    assert not r.resolve([LoraRef(uri=house)], tenant="alice")[0].cached
    assert r.resolve([LoraRef(uri=house)], tenant="alice")[0].cached
    # the producer's check is the same rule, from what the worker publishes
    offer = r.published()
    assert offer.per_tenant and offer.shared_prefixes == (f"{bucket}/shared/",)
    req = RenderRequest(prompt="x", loras=[LoraRef(uri=f"s3://{bucket}/loras/bob/style.safetensors")])
    (problem,) = lora_problems(req, [("w1", offer)], tenant="alice")
    assert "not under tenant 'alice'" in problem
    assert lora_problems(req, [("w1", offer)], tenant="bob") == []
    assert lora_problems(req, [("w1", LoraOffer(None, (f"{bucket}/loras",), 4))], tenant="alice") == []  # no tenants


def test_the_rule_without_tenants_is_the_prefix_list() -> None:
    assert uri_problem("s3://bkt/loras/x/y.safetensors", ["bkt/loras"]) is None
    assert "under no prefix" in str(uri_problem("s3://bkt/other/y.safetensors", ["bkt/loras"]))
    assert uri_problem("s3://bkt/loras/al/y.safetensors", ["bkt/loras"], tenant="al") is None
    assert uri_problem("s3://bkt/loras/alice/y.safetensors", ["bkt/loras/"], tenant="al") is not None  # whole segment


# ==== 11: the header from a ranged GET, before the body ==================================================


def test_an_impossible_header_is_refused_after_a_few_kilobytes(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    size = 24 << 20
    lying = struct.pack("<Q", 1 << 40) + bytes(size - 8)  # declares a 1 TB header
    good_header = write_st(tmp_path / "g.safetensors", lora()).read_bytes()
    wrong_keys = write_st(tmp_path / "w.safetensors", {"not_a_lora.weight": ("BF16", [4, 4])}).read_bytes()
    s3_client.put_object(Bucket=bucket, Key="u/lying.safetensors", Body=lying)
    s3_client.put_object(Bucket=bucket, Key="u/keys.safetensors", Body=wrong_keys + bytes(size))
    s3_client.put_object(Bucket=bucket, Key="u/ok.safetensors", Body=good_header)
    counting = Counting(s3_client)
    r = resolver(tmp_path, counting, lora_s3_prefixes=[f"{bucket}/u/"], lora_max_file_bytes=64 << 20)
    with pytest.raises(LoraRefused, match="header of 1099511627776 bytes, over the"):
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/lying.safetensors")])
    with pytest.raises(LoraRefused, match="(bytes after the last tensor|not a LoRA factor)"):
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/keys.safetensors")])
    assert counting.got <= 2 * (64 << 10), counting.got  # two first ranges, not 48 MB of bodies
    assert not list((tmp_path / "cache").glob("*.safetensors"))
    counting.got = 0
    assert not r.resolve([LoraRef(uri=f"s3://{bucket}/u/ok.safetensors")])[0].cached
    assert counting.got == 2 * len(good_header)  # (header range, then the body)


# ==== 12: bad headers are request errors, never `internal` ================================================


def test_a_header_nested_200000_deep_is_a_lora_error(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    raw = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(LoraFileError, match="nests deeper than 8 levels"):
        check_lora(path, TARGETS)
    s3_client.put_object(Bucket=bucket, Key="u/deep.safetensors", Body=path.read_bytes())
    r = resolver(tmp_path, s3_client, lora_s3_prefixes=[f"{bucket}/u/"])
    with pytest.raises(LoraRefused, match=r"^loras\[0\]: s3://.*nests deeper than 8 levels"):
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/deep.safetensors")])


# ==== 14: strengths of one file add up ===================================================================


def test_one_file_repeated_is_bounded_in_sum(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    with pytest.raises(ValidationError, match="strengths add up to 16 for one file"):
        RenderRequest(prompt="x", loras=[LoraRef(name="a", strength=4.0)] * 4)
    RenderRequest(prompt="x", loras=[LoraRef(name="a", strength=2.0), LoraRef(name="a", strength=2.0)])
    good = write_st(tmp_path / "g.safetensors", lora()).read_bytes()
    for i in range(4):  # the same bytes under four keys: the schema sees four files, the worker one
        s3_client.put_object(Bucket=bucket, Key=f"u/c{i}.safetensors", Body=good)
    r = resolver(tmp_path, s3_client, lora_s3_prefixes=[f"{bucket}/u/"])
    refs = [LoraRef(uri=f"s3://{bucket}/u/c{i}.safetensors", strength=4.0) for i in range(4)]
    RenderRequest(prompt="x", loras=refs)  # (the schema cannot know they are copies)
    with pytest.raises(LoraRefused, match="strengths add up to 16 for one file"):
        r.resolve(refs)


# ==== refusals that need no download come before any; no catalogue oracle =======================================


def test_refusals_that_need_no_download_come_before_any(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    """The strength sum of one file's copies, a runner that fuses no request LoRAs, and a bad header behind a
    good LoRA: each refused with no body fetched and nothing left in the cache (were: the copies fetched, then
    refused; the job failed `runner_error` after its downloads; the good LoRA fetched and cached)."""
    good = write_st(tmp_path / "g.safetensors", lora()).read_bytes()
    for i in range(4):
        s3_client.put_object(Bucket=bucket, Key=f"u/c{i}.safetensors", Body=good)
    s3_client.put_object(Bucket=bucket, Key="u/lying.safetensors", Body=struct.pack("<Q", 1 << 40) + bytes(64))
    counting = Counting(s3_client)
    r = resolver(tmp_path, counting, lora_s3_prefixes=[f"{bucket}/u/"])
    copies = [LoraRef(uri=f"s3://{bucket}/u/c{i}.safetensors", strength=2.0) for i in range(3)]
    with pytest.raises(LoraRefused, match="strengths add up to 6 for one file"):
        r.resolve(copies)
    assert counting.got == 0
    with pytest.raises(LoraRefused, match=r"^loras\[1\]: .*header of 1099511627776 bytes"):
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/c0.safetensors"), LoraRef(uri=f"s3://{bucket}/u/lying.safetensors")])
    assert counting.got <= 2 * len(good) + 72  # the two header ranges (the good one's is the whole small file)
    assert not list((tmp_path / "cache").glob("*.safetensors"))  # the good one's body was never fetched
    s = WorkerSettings(lora_cache_dir=tmp_path / "cache", lora_s3_prefixes=[f"{bucket}/u/"], runner="smoke")
    counting.got = 0
    no_fusion = LoraResolver(s, s3_client=lambda: counting, metrics=WorkerMetrics("g"), takes_loras=False)
    with pytest.raises(LoraRefused, match="runner 'smoke' takes no request LoRAs as it is set up"):
        no_fusion.resolve([LoraRef(uri=f"s3://{bucket}/u/c0.safetensors")])
    assert counting.got == 0 and no_fusion.published().max_per_request == 0  # (refused at submit too)
    assert r.metrics.registry.get_sample_value("ltx_worker_lora_fetch_bytes_total", {"group": "g"}) is None


def test_which_runners_take_request_loras_is_known_before_a_fleet() -> None:
    """What the worker asks before it fetches a job's LoRAs (`MGPURunner.takes_request_loras`): only a runner
    with a LoRA tracker fuses them."""
    from worker.settings.fleets import resolve_runner

    def takes(runner: str, **setup: Any) -> bool:
        return resolve_runner(WorkerSettings(runner=runner)).takes_request_loras(**setup)

    assert not takes("ltx2-distilled") and takes("ltx2-distilled", request_loras=True)
    assert takes("ltx2-two-stage")  # (its distilled LoRA: a tracker anyway)
    assert not takes("smoke") and not takes("noop")


def test_a_catalogue_lora_tells_no_tenant_whether_another_used_it(tmp_path: Path) -> None:
    """With tenants, a catalogue file is cached per tenant like an S3 object: bob's use leaves alice's first
    use a miss (`cached`, `fetch_bytes`, `fetch_s`), where it was a hit on the file bob's job copied."""
    catalogue = tmp_path / "catalogue"
    catalogue.mkdir()
    write_st(catalogue / "dolly.safetensors", lora())
    r = resolver(tmp_path, None, lora_catalogue=catalogue, tenant_ids=True)
    assert not r.resolve([LoraRef(name="dolly")], tenant="bob")[0].cached
    assert r.resolve([LoraRef(name="dolly")], tenant="bob")[0].cached
    first = r.resolve([LoraRef(name="dolly")], tenant="alice")[0]
    assert not first.cached and first.fetch_bytes == (catalogue / "dolly.safetensors").stat().st_size
    assert r.resolve([LoraRef(name="dolly")], tenant="alice")[0].cached
    # the strengths of one catalogue file still add up, whichever tenant's copy a job gets
    with pytest.raises(LoraRefused, match="strengths add up to 6 for one file"):
        r.resolve([LoraRef(name="dolly", strength=3.0)] * 2, tenant="alice")


def test_a_worker_whose_runner_fuses_no_loras_refuses_them_before_any_fetch(
    tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """A live worker (real Redis and SeaweedFS) whose runner is set up without LoRA fusion publishes that it
    takes none (`producer submit` refuses them) and fails a LoRA job `invalid_request` without a fetch (it
    fetched the LoRA, then the runner refused or ignored it)."""
    from tests.support.fleet import running_worker
    from tests.support.workers import wait_state

    good = write_st(tmp_path / "g.safetensors", lora()).read_bytes()
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="loras/u/good.safetensors", Body=good)
    ckpt = write_st(
        tmp_path / "ckpt.safetensors",
        {f"model.diffusion_model.{k}": ("BF16", list(shape)) for k, shape in TARGETS.items()},
    )
    cache = tmp_path / "lora-cache"
    with running_worker(
        tmp_path,
        redis_server,
        s3_server,
        lora_cache_dir=cache,
        lora_s3_prefixes=f"{s3_server.bucket}/loras/u",
        runner_setup=json.dumps({"checkpoint_path": str(ckpt)}),
    ) as w:
        assert w.health()["loras"]["max_per_request"] == 0
        job = w.submit("t", loras=[{"uri": f"s3://{s3_server.bucket}/loras/u/good.safetensors"}])
        assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "failed", job.get_meta(refresh=True)
        error = job.get_meta(refresh=True)["error"]
        assert error["reason"] == "invalid_request" and "takes no request LoRAs" in error["message"], error
        assert not list(cache.glob("*.safetensors"))
