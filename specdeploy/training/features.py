"""Frozen-target features for drafter training, computed on the fly and optionally cached.

Per token we keep what both objectives need: the *inputs* of the EAGLE-3 capture layers (the
checkpoint convention; the deployment captures the output of layer i-1, the same tensor) and the
final-normed hidden state (the MTP input, and through the target's LM head the soft labels).
The target forward dominates training cost on a CPU, so the cache (bf16, one file per fixed batch
index) lets later epochs, resumed runs and the other method's run skip it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Features:
    ids: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T] bool
    aux: torch.Tensor  # [B, T, n_aux * H] inputs of the aux layers, concatenated
    final: torch.Tensor  # [B, T, H] final-normed hidden

    def to(self, device, dtype=None) -> Features:
        cast = (lambda t: t.to(device, dtype)) if dtype is not None else (lambda t: t.to(device))
        return Features(self.ids.to(device), self.mask.to(device), cast(self.aux),
                        cast(self.final))


@torch.no_grad()
def extract(target: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
            aux_layers: tuple[int, ...]) -> Features:
    """Run the frozen target once; pre-forward hooks grab each aux layer's input."""
    layers = target.model.layers
    grabbed: dict[int, torch.Tensor] = {}
    hooks = [layers[i].register_forward_pre_hook(
        lambda _m, args, i=i: grabbed.__setitem__(i, args[0])) for i in aux_layers]
    try:
        final = target.forward_hidden(ids)
    finally:
        for h in hooks:
            h.remove()
    aux = torch.cat([grabbed[i] for i in aux_layers], -1)
    return Features(ids, mask, aux, final)


class FeatureSource:
    """`get(batch_index)` → Features, from `cache_dir` when present there, else computed (and
    written when a cache dir is given). The cache's meta.json pins model, data and layers."""

    def __init__(self, target: nn.Module, batches, aux_layers: tuple[int, ...],
                 cache_dir: str | Path | None = None, key: dict | None = None,
                 device: torch.device | str = "cpu"):
        self.target, self.batches, self.aux_layers = target, batches, tuple(aux_layers)
        self.device = torch.device(device)
        self.cache = Path(cache_dir) if cache_dir else None
        self.hits = self.misses = 0
        self._locks: set[Path] = set()
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            meta = {**(key or {}), "aux_layers": list(self.aux_layers),
                    "batch_size": batches.batch_size, "seq_len": batches.seq_len}
            f = self.cache / "meta.json"
            if f.exists() and json.loads(f.read_text()) != meta:
                raise ValueError(f"feature cache {self.cache} was built for another setup: "
                                 f"{f.read_text()} (wanted {json.dumps(meta)}); use another dir")
            f.write_text(json.dumps(meta))

    def _file(self, index: int) -> Path | None:
        n = self.batches.num_batches()
        index = index % n if n else index
        return None if self.cache is None else self.cache / f"batch_{index:06d}.pt"

    def _wait_for_peer(self, f: Path, patience_s: float = 120.0) -> None:
        """Another run (say the MTP run next to the EAGLE-3 one) computing this batch holds a
        lock file: wait for its result instead of computing the same features twice."""
        lock = f.with_suffix(".lock")
        try:
            lock.touch(exist_ok=False)
            self._locks.add(lock)
            return
        except FileExistsError:
            pass
        t0 = time.time()
        while lock.exists() and not f.exists() and time.time() - t0 < patience_s:
            if time.time() - lock.stat().st_mtime > patience_s:
                break  # stale lock from a killed run
            time.sleep(1.0)

    def get(self, index: int) -> Features:
        f = self._file(index)
        if f is not None and not f.exists():
            self._wait_for_peer(f)
        if f is not None and f.exists():
            try:
                d = torch.load(f, map_location="cpu")
                self.hits += 1
                return Features(**d).to(self.device)
            except Exception:  # a partial write from a killed run: recompute
                f.unlink(missing_ok=True)
        self.misses += 1
        ids, mask = self.batches.batch(index)
        feats = extract(self.target, ids.to(self.device), mask.to(self.device), self.aux_layers)
        if f is not None:
            tmp = f.with_suffix(".tmp")
            cpu = feats.to("cpu", torch.bfloat16)
            torch.save({"ids": cpu.ids, "mask": cpu.mask, "aux": cpu.aux, "final": cpu.final}, tmp)
            tmp.replace(f)
            lock = f.with_suffix(".lock")
            if lock in self._locks:
                lock.unlink(missing_ok=True)
                self._locks.discard(lock)
        return feats
