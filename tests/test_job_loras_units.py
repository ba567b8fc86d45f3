"""Request LoRAs on a rank, without a fleet: the job kwarg's checks (`common.job_loras`), the tracker freeing a
past job's factors, and the one case where a request LoRA and an offline merge can differ: a weight both the
request LoRA and the distilled LoRA touch (bound derived below, element by element).
"""

from __future__ import annotations

import math

import pytest
import torch

from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker
from ltx_mgpu.runners.common.job_loras import job_lora_specs, model_targets

from . import test_lora_tracker
from .test_lora_tracker import _lora_ops, builder

#: the tracker tests' files: a checkpoint, "a" over every 2nd linear weight, "b" over every 3rd (they overlap)
files = test_lora_tracker.files


@pytest.fixture(scope="module")
def model(files):
    return builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)


def test_job_kwarg_is_checked_on_the_rank(files, model) -> None:
    targets = model_targets(model)
    assert job_lora_specs(None, None) == () and job_lora_specs([], targets) == ()
    (spec,) = job_lora_specs([{"path": files["a"], "strength": 0.5}], targets)
    assert (spec.path, spec.strength, spec.sd_ops.name) == (files["a"], 0.5, _lora_ops().name)
    bad = [
        ([{"name": "dolly", "strength": 1.0}], None, "set up without LoRA fusion"),
        ([{"name": "dolly", "strength": 1.0}], targets, r"must be \{'path', 'strength'\}"),
        ([{"path": files["a"], "strength": math.inf}], targets, "strength must be finite"),
        ([{"path": files["a"], "strength": True}], targets, "strength a number"),
        ([{"path": files["ckpt"], "strength": 1.0}], targets, r"loras\[0\]: .*not a LoRA factor"),
        ([{"path": files["a"] + ".gone", "strength": 1.0}], targets, "cannot read"),
    ]
    for loras, tg, message in bad:
        with pytest.raises(ValueError, match=message):
            job_lora_specs(loras, tg)


def test_drop_factors_frees_past_jobs_loras(files) -> None:
    model = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    tracker = LoraWeightTracker()
    tracker.attach(model)
    distilled, request = LoraSpec(files["b"], 1.0, _lora_ops()), LoraSpec(files["a"], 0.8, _lora_ops())
    tracker.apply([distilled, request])
    assert len(tracker._factors) == 2
    tracker.drop_factors([distilled])
    assert list(tracker._factors) == [distilled.factor_key]


def test_overlapping_request_and_distilled_loras_stay_within_the_derived_bound(files) -> None:
    """The tracker fuses request + distilled from clean in one rounding; a checkpoint with the request LoRA
    merged offline and the distilled LoRA fused on top rounds twice. ltx-core (bf16): each delta
    p = bf16(B*s @ A) is the same in both paths, then
        tracker  W1 = r(w + r(pr + pd))          merged  Wm = r(w + pr),  W2 = r(Wm + pd)
    and |r(v) - v| <= ulp(v)/2 <= 2**-8 |v| for bf16 (8 significant bits), so element by element
        |W1 - W2| <= 2**-8 (|pr + pd| + |W1| + |Wm| + |W2|)   (+ the smallest subnormal, for zeros)."""
    ops = _lora_ops()
    tracked = builder(files["ckpt"]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    t1 = LoraWeightTracker()
    t1.attach(tracked)
    t1.apply([LoraSpec(files["a"], 0.8, ops), LoraSpec(files["b"], 1.0, ops)])
    merged = builder(files["ckpt"], [(files["a"], 0.8)]).build(device=torch.device("cpu"), dtype=torch.bfloat16)
    wm = {k: v.clone() for k, v in merged.state_dict().items()}
    t2 = LoraWeightTracker()
    t2.attach(merged)
    t2.apply([LoraSpec(files["b"], 1.0, ops)])
    from safetensors.torch import load_file

    req, dist = load_file(files["a"]), load_file(files["b"])

    def delta(sd: dict, key: str, coef: float) -> torch.Tensor | None:
        prefix = "diffusion_model." + key[: -len(".weight")]
        if f"{prefix}.lora_A.weight" not in sd:
            return None
        return torch.matmul(sd[f"{prefix}.lora_B.weight"] * coef, sd[f"{prefix}.lora_A.weight"]).to(torch.bfloat16)

    w1, w2 = tracked.state_dict(), merged.state_dict()
    overlapping = 0
    for key in w1:
        pr, pd = delta(req, key, 0.8), delta(dist, key, 1.0)
        if pr is None or pd is None:
            assert torch.equal(w1[key], w2[key]), key  # one delta per weight: a single rounding in both paths
            continue
        overlapping += 1
        bound = 2.0**-8 * ((pr.float() + pd.float()).abs() + w1[key].float().abs() + wm[key].float().abs()
                           + w2[key].float().abs()) + 2.0**-133  # fmt: skip
        diff = (w1[key].float() - w2[key].float()).abs()
        assert (diff <= bound).all(), (key, (diff - bound).max().item())
    assert overlapping >= 2


def test_synthetic_user_loras_pass_the_check_against_their_checkpoint(tmp_path) -> None:
    """The generator's user LoRAs (attention projections, ranks 32 and 128) are LoRAs of the synthetic
    transformer: the worker's header check accepts them with the rank they were written at."""
    from ltx_mgpu.lora_file import LoraLimits, check_lora, transformer_targets
    from ltx_mgpu.runners.ltx2.synthetic.profiles import profile
    from ltx_mgpu.runners.ltx2.synthetic.user_loras import main, user_lora_plan
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    main(["--profile", "tiny", "--out", str(tmp_path), "--ranks", "32,128"])
    targets = transformer_targets(ensure_tiny_ltx2().setup_kwargs()["checkpoint_path"])
    for rank in (32, 128):
        checked = check_lora(tmp_path / f"user_lora_r{rank}.safetensors", targets, LoraLimits(max_rank=128))
        assert set(checked.ranks.values()) == {rank}
        assert checked.ranks and all(k.rsplit(".", 2)[-2] in ("to_q", "to_k", "to_v", "0") for k in checked.ranks)
    full = user_lora_plan(profile("full"), 128)  # (sizes only: nothing is written)
    assert len(full.specs) == 2304 and full.nbytes == 1711276032


def test_synthetic_user_loras_of_different_seeds_are_different_loras_of_one_shape(tmp_path) -> None:
    """`python -m bench.e2e loras` needs several first uses of a rank-128 LoRA: files of different seeds have the same
    tensors and shapes but other bytes (so other cache keys and ETags); the same seed writes the same file."""
    from ltx_mgpu.lora_file import read_header
    from ltx_mgpu.runners.ltx2.synthetic.user_loras import write_user_lora

    paths = [tmp_path / f"{name}.safetensors" for name in ("a", "b", "a-again")]
    for path, seed in zip(paths, (1, 2, 1), strict=True):
        row = write_user_lora("tiny", path, 128, seed=seed)
        assert row["bytes"] == path.stat().st_size
    a, b, again = (p.read_bytes() for p in paths)
    headers = [read_header(str(p), max_file_bytes=1 << 30, max_header_bytes=1 << 24) for p in paths]
    assert headers[0] == headers[1] and a != b and a == again
