"""A hybrid family's own MTP module stored on its own, in the checkpoint's key layout.

`specdeploy train-drafter --method mtp` on a NemotronH or Qwen3.5 target writes the family's MTP
module (`nemotron_h_mtp.MTP` / `qwen3_5_mtp.MTP`, fresh or fine-tuned from the checkpoint's
`mtp.*`) as a directory: `config.json` (the target's config with the number of MTP groups set)
plus `mtp.*` tensors exactly as a released checkpoint stores them (per-expert keys, Qwen3.5's
zero-centred norms). Reading goes through the family's own `checkpoint_to_params`, the code that
reads a full checkpoint's `mtp.*`, so a written head and the original module load identically;
a full target checkpoint directory is also accepted (only its `mtp.*` tensors are read).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import assign_params, resolve_dtype
from specdeploy.models.registry import UnsupportedArchitecture, module_for_config

PREFIX = "mtp."
# family module → (config key holding its number of MTP groups, its MTP module)
FAMILIES = {"specdeploy.models.nemotron_h": ("num_nextn_predict_layers",
                                             "specdeploy.models.drafters.nemotron_h_mtp"),
            "specdeploy.models.qwen3_5_moe": ("mtp_num_hidden_layers",
                                              "specdeploy.models.drafters.qwen3_5_mtp"),
            # (Qwen3-Next's model is Qwen3.5-MoE's; its written heads' configs name Qwen3-Next)
            "specdeploy.models.qwen3_next": ("mtp_num_hidden_layers",
                                             "specdeploy.models.drafters.qwen3_5_mtp")}


def family_of(target: nn.Module) -> ModuleType | None:
    """The family module of a hybrid target with an MTP module of its own (else None)."""
    name = type(target).__module__
    return importlib.import_module(name) if name in FAMILIES else None


def group_key(fam: ModuleType) -> str:
    return FAMILIES[fam.__name__][0]


def num_groups(target: nn.Module) -> int:
    """The number of MTP groups the target's config declares (0 when none / not a hybrid)."""
    fam = family_of(target)
    return int(getattr(target.cfg, group_key(fam)) or 0) if fam else 0


def module_groups(mtp: nn.Module) -> int:
    """Groups of an MTP module (NemotronH: `group_len` layers each; Qwen3.5: one layer each)."""
    return len(mtp.layers) // getattr(mtp, "group_len", 1)


def mtp_parts(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The target modules an MTP module borrows: (embedding, LM-head weight holder)."""
    m = target.model
    emb = m.embed_tokens if hasattr(m, "embed_tokens") else m.embeddings
    return emb, target.head if hasattr(target, "head") else target.lm_head


def is_checkpoint_mtp(path: str | os.PathLike) -> bool:
    """A directory whose config is a hybrid family's and that holds `mtp.*` tensors."""
    try:
        reader = CheckpointReader(path)
        fam = module_for_config(reader.config)
    except (CheckpointError, UnsupportedArchitecture, FileNotFoundError, OSError):
        return False
    return fam.__name__ in FAMILIES and reader.has_prefix(PREFIX)


def _new(fam: ModuleType, cfg, target: nn.Module) -> nn.Module:
    cls = importlib.import_module(FAMILIES[fam.__name__][1]).MTP
    return cls(cfg, *mtp_parts(target))


def build_mtp(target: nn.Module, groups: int) -> nn.Module:
    """A family MTP module with `groups` groups for `target` (uninitialised, the target's
    dtype)."""
    fam = family_of(target)
    if fam is None:
        raise CheckpointError(f"checkpoint-layout MTP: {type(target).__name__} has no MTP "
                              "module of its own")
    mtp = _new(fam, replace(target.cfg, **{group_key(fam): groups}), target)
    if hasattr(mtp, "init_buffers"):
        mtp.init_buffers()
    return mtp.to(mtp_parts(target)[0].weight.dtype)


class _MTPOnly:
    """A reader over a directory with (at least) the `mtp.*` tensors: every other key of the
    family's layout reads as present, so `checkpoint_to_params` maps the MTP names as it does in
    a full checkpoint; only `mtp.*` thunks are ever called."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.path, self.config = reader, reader.path, reader.config

    def __contains__(self, key: str) -> bool:
        return key in self.reader or not key.startswith(PREFIX)

    def keys(self):
        return self.reader.keys()

    def has_prefix(self, prefix: str) -> bool:
        return self.reader.has_prefix(prefix)

    def get(self, key: str) -> torch.Tensor:
        return self.reader.get(key)


def load_checkpoint_mtp(path: str | os.PathLike, target: nn.Module,
                        dtype: str | torch.dtype = "auto") -> nn.Module:
    """The family MTP module stored at `path`, borrowing `target`'s embedding and LM head."""
    reader = CheckpointReader(path)
    fam = module_for_config(reader.config)
    if fam is not family_of(target):
        raise CheckpointError(f"{path}: an MTP module of {reader.config.get('architectures')}, "
                              f"but the target is {type(target).__name__}")
    cfg = fam.Config.from_hf(reader.config)
    groups = int(getattr(cfg, group_key(fam)) or 0)
    want = {"hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size}
    bad = [f"{k} {getattr(cfg, k)} vs target {v}" for k, v in want.items()
           if getattr(cfg, k) != v]
    if bad or groups < 1:
        raise CheckpointError(f"{path}: MTP module does not fit the target: "
                              + (", ".join(bad) or f"{group_key(fam)} = {groups}"))
    with torch.device("meta"):
        mtp = _new(fam, cfg, target)
    params = fam.checkpoint_to_params(_MTPOnly(reader), cfg, with_mtp=True)
    params = {k[len(PREFIX):]: f for k, f in params.items() if k.startswith(PREFIX)}
    assign_params(mtp, params, resolve_dtype(dtype, reader.config), str(path))
    if hasattr(mtp, "init_buffers"):
        mtp.init_buffers()
    return mtp.eval()


def save_checkpoint_mtp(mtp: nn.Module, target: nn.Module, out: str | os.PathLike,
                        dtype: torch.dtype | None = None, extra_config: dict | None = None
                        ) -> Path:
    """Write `mtp` as `mtp.*` in the released layout of `target`'s family (its
    `params_to_checkpoint`), with the target's config declaring the module's group count."""
    fam = family_of(target)
    key, groups = group_key(fam), module_groups(mtp)
    sd = {PREFIX + k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
          for k, v in mtp.state_dict().items()}
    tensors = fam.params_to_checkpoint(sd, replace(target.cfg, **{key: groups}))
    hf = dict(getattr(target, "hf_config", None) or {"architectures": [fam.ARCHITECTURES[0]]})
    if "text_config" in hf:  # NOTE: Qwen3.5 reads text_config first; set it where it is read
        hf["text_config"] = {**hf["text_config"], key: groups}
    else:
        hf[key] = groups
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_checkpoint(out, {**hf, **(extra_config or {})}, tensors)
