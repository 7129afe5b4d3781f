"""Lazy, memory-mapped access to checkpoint tensors by name.

NOTE: tensors are read one at a time (safetensors memory-maps the files), so loading a model never
holds the checkpoint and the model in memory at once.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.checkpoint.errors import CheckpointError


class CheckpointReader:
    """Tensor access for a HF-style directory: `config.json` + `*.safetensors` (sharded or not).

    Subclasses (GGUF) provide the same three things: `config`, `keys()`, `get(name)`.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{self.path}: no config.json (not a HF checkpoint directory)")
        try:
            self.config: dict = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}: malformed JSON ({e})") from None
        # NOTE: imported here: hf_config raises this module's CheckpointError (a cycle)
        from specdeploy.checkpoint.hf_config import validate_hf_config

        validate_hf_config(self.config, str(self.path))
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: cannot read safetensors header ({e})") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        self.config = _mtp_count_from_keys(self.config, self._where)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        f = self._where[name]
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f}: tensor {name!r} is unreadable ({e})") from None

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self._where)

    def missing(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self._where]


def _mtp_count_from_keys(config: dict, keys) -> dict:
    """Qwen3-Next releases ship their MTP layer (`mtp.fc`, `mtp.layers.N.*`, Qwen3.5's names)
    without declaring it (no `mtp_num_hidden_layers`): the count comes from the tensors, as
    vLLM and llama.cpp's converter take it. Configs that declare theirs are left alone."""
    text = config.get("text_config", config)
    if "mtp.fc.weight" not in keys or any(k in text for k in ("mtp_num_hidden_layers",
                                                              "num_nextn_predict_layers")):
        return config
    layers = {int(k.split(".")[2]) for k in keys if k.startswith("mtp.layers.")
              and k.split(".")[2].isdigit()}
    text = {**text, "mtp_num_hidden_layers": max(layers) + 1 if layers else 0}
    return {**config, "text_config": text} if "text_config" in config else text


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open a HF directory or a `.gguf` file (or a Hub id already in the local HF cache)."""
    from specdeploy.checkpoint.hub import resolve_model_path

    p = resolve_model_path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_file() and p.suffix == ".gguf":
        from specdeploy.checkpoint.gguf import GGUFReader

        return GGUFReader(p)
    if p.is_dir():
        return CheckpointReader(p)
    raise CheckpointError(f"{p}: expected a checkpoint directory or a .gguf file")


class RowSlice(NamedTuple):
    """A parameter that is rows start..stop-1 of one checkpoint tensor (Phi-3's q / k / v of
    `qkv_proj`): GGUF blocks are per row, so its blocks are that tensor's rows of blocks."""

    key: str
    start: int
    stop: int


def from_keys(thunk, source):
    """Marks a parameter's loader (`checkpoint_to_params`' thunk) as reading checkpoint tensors
    unchanged: `source` is a key, or for stacked experts one list of keys per expert whose rows
    it joins ([[gate, up], ...] or [[down], ...]), or a `RowSlice` of one key's rows. The
    loader then asks the reader for their
    GGUF blocks (`get_blocks`, loading.py), whatever the parameter is named."""
    thunk.source = source
    return thunk
