"""`LoraCache`'s durability off the job's path: a committed LoRA is usable before its fsync, marked durable
after it, and a file from an earlier boot that was never marked is dropped (it may be torn)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from worker.render import lora_cache
from worker.render.lora_cache import LoraCache


def _commit(cache: LoraCache, key: str, data: bytes) -> Path:
    with cache.incoming(len(data)) as tmp:
        tmp.write_bytes(data)
        return cache.commit(tmp, key)


def _later(cache: LoraCache) -> LoraCache:
    if not cache._durable_later():
        pytest.skip("this file system keeps no user xattrs, or the boot time is unknown: commits fsync first")
    return cache


def test_a_commit_is_usable_before_its_fsync_and_durable_after(tmp_path: Path, monkeypatch) -> None:
    cache = _later(LoraCache(tmp_path / "c", cap_bytes=1 << 20))
    release, synced = threading.Event(), []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:  # the disk takes its time: the job must not wait for it
        assert release.wait(30)
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(lora_cache.os, "fsync", slow_fsync)
    path = _commit(cache, "a", b"factors")
    assert path.read_bytes() == b"factors" and cache.get("a") == path  # in use while its fsync waits
    assert not synced and not cache.wait_durable(timeout=0.05)
    release.set()
    assert cache.wait_durable(timeout=30) and synced
    assert os.getxattr(path, lora_cache._DURABLE_XATTR) == b"1"


def test_a_file_from_an_earlier_boot_is_kept_only_if_marked_durable(tmp_path: Path) -> None:
    cache = _later(LoraCache(tmp_path / "c", cap_bytes=1 << 20))
    durable = _commit(cache, "durable", b"d")
    assert cache.wait_durable(timeout=30)
    torn = cache.path_for("torn")  # renamed in by a process that died, and the machine with it, before its fsync
    torn.write_bytes(b"t")
    before_boot = float(cache.boot_time) - 100
    for path in (durable, torn):
        os.utime(path, (before_boot, before_boot))
    after_reboot = LoraCache(tmp_path / "c", cap_bytes=1 << 20)  # (another process: nothing of its own syncing)
    assert after_reboot.get("durable") == durable
    assert after_reboot.get("torn") is None and not torn.exists()  # fetched again, never read
    fresh = cache.path_for("fresh")  # written in this boot: the page cache holds it whole, fsynced or not
    fresh.write_bytes(b"f")
    assert after_reboot.get("fresh") == fresh


def test_without_xattrs_a_commit_fsyncs_before_its_rename(tmp_path: Path, monkeypatch) -> None:
    cache = LoraCache(tmp_path / "c", cap_bytes=1 << 20)
    cache._xattrs = False  # (a file system without user xattrs: nothing could mark a file durable later)
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(lora_cache.os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(lora_cache.os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1])
    path = _commit(cache, "a", b"x")
    assert order == ["fsync", "replace"] and cache.get("a") == path
    old = float(cache.boot_time or 0) - 100
    os.utime(path, (old, old))
    assert cache.get("a") == path  # (fsynced before it was renamed in: trusted after a reboot)


@pytest.mark.parametrize("size", [0, 5, 4096 * 7 + 3])
def test_a_catalogue_copy_is_the_files_bytes_and_their_sha256(tmp_path: Path, monkeypatch, size: int) -> None:
    """The catalogue copy hashes one chunk while the previous one is written: the order and the digest hold."""
    import hashlib

    from worker.render import lora_fetch

    monkeypatch.setattr(lora_fetch, "_CHUNK", 4096)  # (many chunks in flight on a small file)
    source, dest = tmp_path / "s", tmp_path / "d"
    source.write_bytes(os.urandom(size))
    assert lora_fetch.copy_hashing(source, dest) == hashlib.sha256(source.read_bytes()).hexdigest()
    assert dest.read_bytes() == source.read_bytes()


# ==== files as well as bytes, shares ===================================================================


def test_the_file_cap_holds_at_every_admission_like_the_byte_cap(tmp_path: Path) -> None:
    """Tiny files under new keys: the byte cap never binds, the file cap does (each file is an inode)."""
    from worker.render.lora_cache import LoraCacheFull

    cache = LoraCache(tmp_path / "c", cap_bytes=1 << 20, cap_files=3)
    for i in range(8):
        _commit(cache, f"tiny{i}", b"x" * 554)
        cache.release()
        assert cache.files() <= 3, i  # after every admission, not eventually
    assert cache.usage() <= 3 * 554 and cache.get("tiny7") is not None and cache.get("tiny0") is None
    for key in ("a", "b"):  # with "tiny7" pinned above, three files pinned: nothing left to evict
        _commit(cache, key, b"y")
    with pytest.raises(LoraCacheFull, match=r"3 files in use, its cap is 3 \(LTX_LORA_CACHE_FILES\)"):
        cache.incoming(1).__enter__()
    cache.release()
    _commit(cache, "c", b"z")  # unpinned now: the least recently used makes room


def test_each_process_sharing_the_cache_gets_its_share(tmp_path: Path) -> None:
    """`share()`: the caps over the live processes that joined (each LoraCache object stands for one here:
    its own lock file); a process that died is counted out."""
    first = LoraCache(tmp_path / "c", cap_bytes=1000, cap_files=10)
    assert first.share() == (1000, 10, 1)
    second = LoraCache(tmp_path / "c", cap_bytes=1000, cap_files=10)
    second.join()
    assert first.share() == (500, 5, 2) == second.share()
    assert second._member is not None
    os.close(second._member)  # (its process died: the lock went with it)
    assert first.share() == (1000, 10, 1) and len(list((tmp_path / "c").glob(".member-*"))) == 1
