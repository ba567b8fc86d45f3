"""`LoraWeightTracker`: switch the LoRAs fused into a resident transformer in place, with the fusion work
and the clean-weight backup sharded across the ranks of a group.

Why: a fleet keeps one transformer resident per rank and the two-stage pipeline runs stage 1 without the
distilled LoRA and stage 2 with it. Rebuilding the model per stage would reload the checkpoint and
reallocate every weight (and defeat `torch.compile`/CUDA graphs, which need stable addresses). Fusing on
every rank would repeat the same work W times and need a full clean copy per rank.

How (every rank of `group`, same order):
- `attach(model)`: every LoRA-able weight (a >= 2-D floating `*.weight`, plus its `*.weight_scale` when
  present) gets one owner rank, chosen by a deterministic greedy balance on bytes (the same on every
  rank: it depends only on names and sizes). Each rank clones only the weights it owns: the clean backup
  costs ~1/W of the model per rank.
- `apply(loras)` (collective): the keys touched by the previous or the requested LoRAs are the affected
  set (known on every rank from the LoRA files' headers). Each owner restores those of its affected keys
  that a LoRA is fused into now from the clean backup (the others hold their clean bytes already) and
  fuses the requested LoRAs into them with ltx-core's own `apply_loras` (so the result is bit-identical
  to a single-process `SingleGPUModelBuilder(...).lora(...).build()`; fp8-mm's per-channel e4m3 weights,
  a layout ltx-core does not know, go through `fp8.lora.fuse_rowwise` instead), then every owner's affected
  tensors are broadcast to all ranks through one bucketed uint8 staging buffer, written into the
  parameters in place (addresses never change). Requesting the current set is a no-op.
- `reset()` (collective) is `apply(())`: the affected keys get their exact clean bytes back.

LoRA identity is the set of (path, strength, sd-ops name) with non-zero strength, order-insensitive. Kept
factors are keyed by (path, sd-ops name) only (`LoraSpec.factor_key`): they are the file's tensors through the
key mapping, the strength is applied at fusion, so one file used at two strengths is read once.
`device_cache_bytes` keeps, besides the setup's and the current job's, the factors of recently used request
LoRAs up to that many bytes per rank (least recently used evicted first), so switching back to one reads
nothing. A path always names the same bytes: the worker's LoRA cache names files by content
(`worker.render.loras`), so a file replaced under the same name arrives under a new path, never as stale
factors (setup LoRAs are read once at setup anyway).
Only tensors are moved; the model's module structure (and any shared-weight sibling built with
`tdp.shared_weights_model`) sees the new weights because they alias the same storage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...fp8.lora import fuse_rowwise, is_rowwise_fp8
from ..sharding.collectives import needs_host_staging
from .lora_units import SCALE_SUFFIX, LoraSpec, assign_owners, lora_targets, lora_units, tracked_tensors

__all__ = ["LoraSpec", "LoraWeightTracker", "assign_owners", "lora_units", "tracked_tensors"]
_ = lora_units  # (re-exported: the tracker's selection lives in `lora_units`)

_SCALE_SUFFIX = SCALE_SUFFIX
_FUSABLE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  #: what ltx-core's apply_loras fuses


class LoraWeightTracker:
    """See the module docstring.

    Args:
        group: process group whose ranks share the work (None = default group; world 1 works too).
        bucket_bytes: size of the broadcast staging buffer (the reference uses 256 MiB).
        backup_device: where the clean shards live (default: each weight's own device; "cpu": one page-locked
            host buffer, the memory plan's `lora_backup_at="host"`: a restore copies them back over the host link).
        lora_load_device: where LoRA tensors are read to (default CPU, as ltx-core's builder does).
        keep_loras: keep the LoRA factors of this rank's keys on their weight's device after the first
            fusion, so later swaps read nothing from disk (at real size, re-reading a rank's share of a
            7 GB LoRA from the file per swap is most of a swap). Costs the owned share of the LoRA files.
        device_cache_bytes: bytes of factors of LoRAs neither kept by `drop_factors` nor current that this
            rank still holds, least recently used dropped first (0: none; the runners' `lora_device_cache_gib`).
        factor_device: where kept factors live (default: their weight's device; "cpu": page-locked host memory, the
            plan's `lora_factors_at="host"`: each fusion copies a weight's factors to its device first).
        factor_reader: `(path, names, device) -> {name: tensor}`, how kept factors are read from a LoRA file
            (None: safetensors tensor by tensor, each a synchronous copy from pageable memory: 2,304 of them,
            ~0.5 s, for a rank-128 19B LoRA on an H200). The runners pass the staged reader of
            `runners.common.fast_load`; the bytes, hence the fusion, are the same either way.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_bytes: int = 256 << 20,
        backup_device: torch.device | str | None = None,
        lora_load_device: torch.device | str = "cpu",
        keep_loras: bool = True,
        device_cache_bytes: int = 0,
        factor_reader: Callable[[str, Sequence[str], torch.device], dict[str, torch.Tensor]] | None = None,
        factor_device: torch.device | str | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.bucket_bytes = int(bucket_bytes)
        self.backup_device = None if backup_device is None else torch.device(backup_device)
        self.lora_load_device = torch.device(lora_load_device)
        self._working: dict[str, torch.Tensor] | None = None  # name -> the parameter's tensor (aliased)
        self._owners: dict[str, int] = {}
        self._clean: dict[str, torch.Tensor] = {}  # owned keys only
        self._current: tuple[LoraSpec, ...] = ()
        self._touched_current: set[str] = set()
        self._staging: torch.Tensor | None = None
        self.keep_loras = keep_loras
        self.device_cache_bytes = max(0, int(device_cache_bytes))
        self.factor_reader = factor_reader
        self.factor_device = None if factor_device is None else torch.device(factor_device)
        self._restored: Any = None  # the event of an asynchronous `reset` still copying (one rank only)
        # factor_key -> {"<prefix>.lora_A.weight" / "...lora_B.weight": factor on the weight's device}, least
        # recently used first (a use moves a key to the end)
        self._factors: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.stats = {"swaps": 0, "bytes_broadcast": 0, "keys_fused": 0, "keys_restored": 0, "lora_bytes_read": 0}

    # ---- attach ----------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Track `model`'s LoRA-able weights (names as in `model.state_dict()`, e.g. an `LTXModel`'s).

        Not collective. Must be called with the same model structure on every rank.
        """
        if self._working is not None:
            raise RuntimeError("LoraWeightTracker is already attached to a model")
        working = tracked_tensors(model)
        for name, t in working.items():
            if not t.is_contiguous():
                raise RuntimeError(f"LoraWeightTracker: weight '{name}' is not contiguous")
        self._owners = assign_owners({k: t.numel() * t.element_size() for k, t in working.items()}, self.world_size)
        mine = [k for k in working if self._owners[k] == self.rank]
        if self.backup_device is not None and self.backup_device.type == "cpu" and mine:
            from ...runners.common.host_tier import pack_pinned  # one page-locked buffer, not 1,000 rounded blocks

            device = working[mine[0]].device
            self._clean = dict(zip(mine, pack_pinned([working[k].detach() for k in mine], device), strict=True))
        else:
            self._clean = {
                k: working[k].detach().to(device=self.backup_device or working[k].device, copy=True) for k in mine
            }
        self._working = working

    @property
    def current(self) -> tuple[LoraSpec, ...]:
        """The LoRAs fused now (non-zero strengths), in the order they were requested."""
        return self._current

    def drop_factors(self, keep: Iterable[Any]) -> None:
        """Free the kept LoRA factors of LoRAs not in `keep`, least recently used first, until those left
        hold at most `device_cache_bytes` (per-request LoRAs come and go; without this, `keep_loras` would
        hold every LoRA any job ever used)."""
        wanted = {LoraSpec.coerce(x).factor_key for x in keep}
        others = [k for k in self._factors if k not in wanted]  # oldest use first
        held = sum(self._factor_bytes(k) for k in others)
        for key in others:
            if held <= self.device_cache_bytes:
                break
            held -= self._factor_bytes(key)
            del self._factors[key]

    def _factor_bytes(self, key: tuple[str, str]) -> int:
        return sum(t.nbytes for t in self._factors[key].values())

    def owned_bytes(self) -> int:
        """Bytes of clean backup this rank holds."""
        return sum(t.numel() * t.element_size() for t in self._clean.values())

    def held_bytes(self) -> dict[str, int]:
        """What this rank's tracker holds now, in bytes: the clean backup, the kept LoRA factors and the
        broadcast staging buffer (what the memory plan's `lora_parts` predicts)."""
        factors = sum(self._factor_bytes(key) for key in self._factors)
        staging = 0 if self._staging is None else self._staging.nbytes
        return {"backup": self.owned_bytes(), "factors": factors, "staging": staging}

    # ---- apply / reset ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Collective: restore the exact clean weights of every key a LoRA changed."""
        self.apply(())

    def reset_async(self) -> bool:
        """`reset()` started on a side stream, on one rank with its clean copy in host memory: the copy back runs
        beside whatever the device does next (the video decode) and the next `apply` (or `wait_restored`) waits
        for it. Several ranks restore through broadcasts, which must not run beside the decode's collectives:
        there it is the plain `reset()`. Returns whether it went asynchronous."""
        if self._working is None or not self._current:
            return False
        device = next(iter(self._working.values())).device
        host = self.backup_device is not None and self.backup_device.type == "cpu"
        if self.world_size != 1 or device.type != "cuda" or not host:
            self.reset()
            return False
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # (after the last kernel that reads the fused weights)
        with torch.cuda.stream(side):
            self.apply(())
            event = torch.cuda.Event()
            event.record(side)
        self._restored = (device, event)
        return True

    def wait_restored(self) -> None:
        """Order the current stream after an asynchronous `reset_async` copy (a no-op when none is in flight)."""
        if self._restored is not None:
            device, event = self._restored
            torch.cuda.current_stream(device).wait_event(event)
            self._restored = None

    def apply(self, loras: Iterable[Any], *, keep_factors: Iterable[Any] | None = None) -> None:
        """Collective: make the fused LoRAs exactly `loras` (see the module docstring). `keep_factors`: free
        first the kept factors of every LoRA neither in it nor in `loras` (`drop_factors`), so a past job's
        factors and this one's are never held together (the memory plan counts one job's)."""
        if self._working is None:
            raise RuntimeError("LoraWeightTracker.apply before attach(model)")
        self.wait_restored()
        specs = tuple(s for s in (LoraSpec.coerce(x) for x in loras) if s.strength != 0.0)
        for spec in specs:  # a use: the most recently used (`drop_factors` evicts the least first)
            if spec.factor_key in self._factors:
                self._factors[spec.factor_key] = self._factors.pop(spec.factor_key)
        if keep_factors is not None:
            self.drop_factors((*keep_factors, *specs))
        if sorted(s.identity for s in specs) == sorted(s.identity for s in self._current):
            return
        # Validation below runs on every rank from the same inputs, before any collective: a bad request
        # raises the same ValueError everywhere (recoverable), never on the owners only.
        for spec in specs:
            if not os.path.isfile(spec.path):
                raise ValueError(f"LoRA file not found: {spec.path}")
        targets = [lora_targets(s) for s in specs]
        touched_new = set().union(*(t.keys() for t in targets)) & set(self._working) if targets else set()
        unsupported = sorted(k for k in touched_new if self._working[k].dtype not in _FUSABLE_DTYPES)
        if unsupported:
            raise ValueError(
                f"LoRA fusion supports {sorted(str(d) for d in _FUSABLE_DTYPES)} weights (ltx-core apply_loras); "
                f"'{unsupported[0]}' is {self._working[unsupported[0]].dtype}. Load the transformer in bfloat16."
            )
        affected = self._with_scales(touched_new | self._touched_current)
        mine = sorted(k for k in affected if self._owners[k] == self.rank)
        # Only keys a LoRA is fused into now differ from their clean bytes: the others (all of them after a
        # reset, i.e. the two-stage runner's stage-2 swap) already hold them and need no copy.
        dirty = self._with_scales(self._touched_current)
        with torch.no_grad():
            for key in (k for k in mine if k in dirty):  # restore clean first: fusion starts from clean bytes
                self._working[key].copy_(self._clean[key], non_blocking=True)  # (stream-ordered; pinned: async)
                self.stats["keys_restored"] += 1
            self._fuse(sorted(k for k in mine if k in touched_new), specs, targets)
            self._broadcast(sorted(affected))
        self._current = specs
        self._touched_current = touched_new
        self.stats["swaps"] += 1

    def _with_scales(self, keys: set[str]) -> set[str]:
        out = set(keys)
        for key in keys:
            scale = key[: -len(".weight")] + _SCALE_SUFFIX
            if scale in self._working:
                out.add(scale)
        return out

    def _fuse(self, keys: Sequence[str], specs: Sequence[LoraSpec], targets: Sequence[dict]) -> None:
        """Fuse `specs` into this rank's `keys` with ltx-core's `apply_loras`, one LoRA file read at a time."""
        if not keys:
            return
        from ltx_core.loader.fuse_loras import apply_loras
        from ltx_core.loader.primitives import LoraStateDictWithStrength, StateDict
        from safetensors import safe_open

        lora_sds = []
        for spec, target in zip(specs, targets, strict=True):
            wanted = {k: target[k] for k in keys if k in target}
            kept = self._factors.setdefault(spec.factor_key, {}) if self.keep_loras else {}
            missing = {k: raw for k, raw in wanted.items() if f"{k[: -len('.weight')]}.lora_A.weight" not in kept}
            if missing and self.keep_loras and self.factor_reader is not None:
                self._read_factors(spec, missing, kept)
            elif missing:
                with safe_open(spec.path, framework="pt", device=str(self.lora_load_device)) as f:
                    for key, (raw_a, raw_b) in missing.items():
                        prefix = key[: -len(".weight")]
                        home = self.factor_device or self._working[key].device
                        device = home if self.keep_loras else self.lora_load_device
                        for name, raw in ((f"{prefix}.lora_A.weight", raw_a), (f"{prefix}.lora_B.weight", raw_b)):
                            value = self._mapped(spec, raw, f.get_tensor(raw)).to(device)
                            kept[name] = value
                            self.stats["lora_bytes_read"] += value.nbytes
            sd: dict[str, torch.Tensor] = {}
            for key in wanted:
                prefix = key[: -len(".weight")]
                for name in (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"):
                    sd[name] = kept[name]  # (host-tier factors travel in the key loop below, one weight at a time)
            size = sum(t.nbytes for t in sd.values())
            where = next(iter(sd.values())).device if sd else self.lora_load_device
            sd_obj = StateDict(sd, where, size, {t.dtype for t in sd.values()})
            lora_sds.append(LoraStateDictWithStrength(sd_obj, spec.strength))
        for key in keys:
            # One key at a time keeps the transient fp32/bf16 deltas to a single weight's size.
            part = {key: self._working[key]}
            scale = key[: -len(".weight")] + _SCALE_SUFFIX
            if scale in self._working:
                part[scale] = self._working[scale]
            if is_rowwise_fp8(self._working[key], part.get(scale)):  # fp8-mm's layout: not ltx-core's
                prefix = key[: -len(".weight")]
                device = self._working[key].device
                factors = [
                    (
                        lsd.state_dict.sd[f"{prefix}.lora_A.weight"].to(device, non_blocking=True),
                        lsd.state_dict.sd[f"{prefix}.lora_B.weight"].to(device, non_blocking=True),
                        lsd.strength,
                    )
                    for lsd in lora_sds
                    if f"{prefix}.lora_A.weight" in lsd.state_dict.sd
                ]
                q, s = fuse_rowwise(self._working[key], self._working[scale], factors)
                self._working[key].copy_(q)
                self._working[scale].copy_(s)
                self.stats["keys_fused"] += 1
                continue
            model_sd = StateDict(part, self._working[key].device, 0, {t.dtype for t in part.values()})
            fused = apply_loras(model_sd, lora_sds, dtype=None).sd
            for k, value in fused.items():
                self._working[k].copy_(value)
            self.stats["keys_fused"] += 1

    def _read_factors(self, spec: LoraSpec, missing: dict[str, tuple[str, str]], kept: dict[str, torch.Tensor]) -> None:
        """`missing` keys' factors through `factor_reader`, one read per device their weights live on."""
        by_device: dict[torch.device, list[str]] = {}
        for key in missing:
            by_device.setdefault(self.factor_device or self._working[key].device, []).append(key)
        for device, keys in by_device.items():
            raws = [raw for key in keys for raw in missing[key]]
            got = self.factor_reader(spec.path, raws, device)
            fresh: dict[str, torch.Tensor] = {}
            for key in keys:
                prefix = key[: -len(".weight")]
                for name, raw in zip((f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"), missing[key], strict=True):
                    fresh[name] = self._mapped(spec, raw, got[raw])
                    self.stats["lora_bytes_read"] += fresh[name].nbytes
            if device.type == "cpu" and self._working[keys[0]].device.type == "cuda":  # host tier: page-locked
                from ...runners.common.host_tier import pack_pinned

                fresh = dict(zip(fresh, pack_pinned(list(fresh.values()), self._working[keys[0]].device), strict=True))
            kept.update(fresh)

    @staticmethod
    def _mapped(spec: LoraSpec, raw: str, value: torch.Tensor) -> torch.Tensor:
        if spec.sd_ops is None:
            return value
        key = spec.sd_ops.apply_to_key(raw)
        results = spec.sd_ops.apply_to_key_value(key, value)
        return results[0].new_value if results else value

    # ---- bucketed broadcast ----------------------------------------------------------------------------
    def _staging_buffer(self, device: torch.device) -> torch.Tensor:
        if self._staging is None or self._staging.device != device:
            self._staging = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        return self._staging

    def _broadcast(self, keys: Sequence[str]) -> None:
        """Every owner's tensors among `keys` to every rank, in rounds of at most `bucket_bytes`."""
        if self.world_size == 1 or not keys:
            return
        assert self._working is not None
        any_tensor = self._working[keys[0]]
        staged = needs_host_staging(self.group, any_tensor.device)
        device = torch.device("cpu") if staged or any_tensor.device.type == "cpu" else any_tensor.device
        staging = self._staging_buffer(device)
        for owner in range(self.world_size):
            pieces: list[tuple[torch.Tensor, int, int]] = []  # (byte view, start, length) in this round
            filled = 0
            for key in (k for k in keys if self._owners[k] == owner):
                flat = self._working[key].reshape(-1).view(torch.uint8)
                offset = 0
                while offset < flat.numel():
                    take = min(flat.numel() - offset, self.bucket_bytes - filled)
                    pieces.append((flat, offset, take))
                    filled += take
                    offset += take
                    if filled == self.bucket_bytes:
                        self._round(owner, staging, pieces, filled)
                        pieces, filled = [], 0
            if filled:
                self._round(owner, staging, pieces, filled)

    def _round(self, owner: int, staging: torch.Tensor, pieces: list[tuple[torch.Tensor, int, int]], n: int) -> None:
        src = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        pos = 0
        if self.rank == owner:
            for flat, offset, length in pieces:
                staging[pos : pos + length].copy_(flat[offset : offset + length])
                pos += length
        dist.broadcast(staging[:n], src=src, group=self.group)
        self.stats["bytes_broadcast"] += n
        if self.rank != owner:
            pos = 0
            for flat, offset, length in pieces:
                flat[offset : offset + length].copy_(staging[pos : pos + length])
                pos += length
