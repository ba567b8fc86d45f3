"""`ltx_mgpu.lora_file`: a LoRA file is checked from its header alone, and each bad kind is refused with a
message naming what is wrong. Files are crafted byte by byte (no torch needed); one case checks a real
ComfyUI-style LoRA written with safetensors against a real tiny transformer checkpoint, so the naming the
checker expects is the naming ltx-core fuses.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import pytest

from ltx_mgpu.lora_file import LoraFileError, LoraLimits, check_lora, read_header, transformer_targets

TARGETS = {"transformer_blocks.0.attn1.to_q.weight": (64, 32), "transformer_blocks.0.ff.net.0.proj.weight": (128, 64)}
_SIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def write_st(path: Path, tensors: dict[str, tuple[str, list[int]]], *, cut: int = 0, header_pad: int = 0) -> Path:
    """A safetensors file of zero-filled tensors {key: (dtype, shape)}; `cut` bytes removed from the end."""
    header: dict = {}
    offset = 0
    for key, (dtype, shape) in tensors.items():
        n = _SIZE[dtype]
        for d in shape:
            n *= d
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode() + b" " * header_pad
    data = struct.pack("<Q", len(raw)) + raw + bytes(offset)
    path.write_bytes(data[: len(data) - cut] if cut else data)
    return path


def lora(rank: int = 4, dtype: str = "BF16", prefix: str = "diffusion_model.") -> dict[str, tuple[str, list[int]]]:
    out = {}
    for key, (rows, cols) in TARGETS.items():
        base = prefix + key[: -len(".weight")]
        out[f"{base}.lora_A.weight"] = (dtype, [rank, cols])
        out[f"{base}.lora_B.weight"] = (dtype, [rows, rank])
    return out


def test_a_good_lora_passes_with_or_without_the_comfy_prefix(tmp_path):
    for prefix in ("diffusion_model.", ""):
        checked = check_lora(write_st(tmp_path / f"ok{prefix}.safetensors", lora(prefix=prefix)), TARGETS)
        assert checked.ranks == dict.fromkeys(TARGETS, 4)
        assert checked.max_rank == 4


def test_unknown_key_is_refused(tmp_path):
    bad = {**lora(), "diffusion_model.transformer_blocks.9.attn1.to_q.lora_A.weight": ("BF16", [4, 32])}
    with pytest.raises(LoraFileError, match=r"transformer_blocks\.9\.attn1\.to_q\.weight.*not a LoRA-able"):
        check_lora(write_st(tmp_path / "x.safetensors", bad), TARGETS)
    other = {**lora(), "diffusion_model.transformer_blocks.0.attn1.to_q.alpha": ("F32", [])}
    with pytest.raises(LoraFileError, match=r"to_q\.alpha.*not a LoRA factor"):
        check_lora(write_st(tmp_path / "y.safetensors", other), TARGETS)
    kohya = {k.replace("lora_A", "lora_down").replace("lora_B", "lora_up"): v for k, v in lora().items()}
    with pytest.raises(LoraFileError, match="lora_down.*not a LoRA factor"):
        check_lora(write_st(tmp_path / "z.safetensors", kohya), TARGETS)


def test_wrong_shapes_and_a_missing_factor_are_refused(tmp_path):
    bad = lora()
    bad["diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight"] = ("BF16", [4, 33])
    with pytest.raises(LoraFileError, match=r"to_q\.weight' is 64x32; lora_A \[4, 33\]"):
        check_lora(write_st(tmp_path / "a.safetensors", bad), TARGETS)
    mismatch = lora()
    mismatch["diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight"] = ("BF16", [64, 8])
    with pytest.raises(LoraFileError, match="do not fit"):
        check_lora(write_st(tmp_path / "b.safetensors", mismatch), TARGETS)
    half = lora()
    del half["diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight"]
    with pytest.raises(LoraFileError, match="no lora_B factor"):
        check_lora(write_st(tmp_path / "c.safetensors", half), TARGETS)


def test_rank_over_the_limit_is_refused(tmp_path):
    path = write_st(tmp_path / "r.safetensors", lora(rank=16))
    assert check_lora(path, TARGETS, LoraLimits(max_rank=16)).max_rank == 16
    with pytest.raises(LoraFileError, match="rank 16; allowed 1..8"):
        check_lora(path, TARGETS, LoraLimits(max_rank=8))


def test_bad_dtype_is_refused(tmp_path):
    with pytest.raises(LoraFileError, match="is F64; allowed"):
        check_lora(write_st(tmp_path / "d.safetensors", lora(dtype="F64")), TARGETS)
    for dtype in ("F16", "F32"):
        check_lora(write_st(tmp_path / f"{dtype}.safetensors", lora(dtype=dtype)), TARGETS)


def test_truncated_file_is_refused(tmp_path):
    with pytest.raises(LoraFileError, match="truncated"):
        check_lora(write_st(tmp_path / "t.safetensors", lora(), cut=1), TARGETS)
    with pytest.raises(LoraFileError, match="truncated"):  # cut inside the header itself
        check_lora(write_st(tmp_path / "h.safetensors", {}, header_pad=0, cut=1), TARGETS)
    extra = write_st(tmp_path / "e.safetensors", lora())
    extra.write_bytes(extra.read_bytes() + b"\0")
    with pytest.raises(LoraFileError, match="1 bytes after the last tensor"):
        check_lora(extra, TARGETS)


def test_overlapping_or_lying_offsets_are_refused(tmp_path):
    path = write_st(tmp_path / "o.safetensors", lora())
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    first = next(iter(header))
    header[first]["data_offsets"][1] += 2  # claims more bytes than its shape holds
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(LoraFileError, match="do not hold"):
        check_lora(path, TARGETS)


def test_pickle_and_zip_are_refused_by_their_first_bytes(tmp_path):
    pkl = tmp_path / "p.safetensors"
    pkl.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(LoraFileError, match="pickle"):
        check_lora(pkl, TARGETS)
    zipped = tmp_path / "z.safetensors"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    with pytest.raises(LoraFileError, match="zip archive"):
        check_lora(zipped, TARGETS)
    junk = tmp_path / "j.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(LoraFileError, match="not JSON"):
        check_lora(junk, TARGETS)


def test_oversized_file_and_header_are_refused_without_reading_them(tmp_path):
    big = tmp_path / "big.safetensors"
    write_st(big, lora())
    with open(big, "r+b") as f:
        f.truncate(20 << 30)  # sparse: 20 GB apparent, nothing written
    with pytest.raises(LoraFileError, match=r"21474836480 bytes, over the \d+ byte limit"):
        check_lora(big, TARGETS)
    with pytest.raises(LoraFileError, match="header of 4096 bytes, over the 1024 byte limit"):
        read_header(write_st(tmp_path / "hdr.safetensors", {}, header_pad=4094), max_file_bytes=1 << 20,
                    max_header_bytes=1024)  # fmt: skip
    with pytest.raises(LoraFileError, match="cannot read"):
        check_lora(tmp_path / "missing.safetensors", TARGETS)


def test_a_real_lora_checks_against_a_real_checkpoint(tmp_path):
    """safetensors' own writer and the tiny LTX-2 transformer: the targets are the tracker's weights."""
    from tests.test_lora_tracker import write_checkpoint, write_lora

    ckpt = write_checkpoint(tmp_path / "transformer.safetensors")
    targets = transformer_targets(ckpt)
    assert "transformer_blocks.0.attn1.to_q.weight" in targets
    checked = check_lora(write_lora(tmp_path / "a.safetensors", ckpt, seed=1, every=2, rank=4), targets)
    assert checked.max_rank == 4 and len(checked.ranks) == (len(targets) + 1) // 2
