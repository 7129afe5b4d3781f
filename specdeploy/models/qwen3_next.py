"""Qwen3-Next (`Qwen3NextForCausalLM`, e.g. Qwen3-Next-80B-A3B): gated delta net + gated
attention layers (3 : 1), routed experts with a gated shared expert, an MTP layer; Qwen3.5-MoE's
blocks (models/qwen3_5_blocks.py, the same math) under plain 1-D RoPE.

What differs is the checkpoint: each GDN layer projects with `in_proj_qkvz` [2K + 2V, H] and
`in_proj_ba` [2 nv, H], grouped per key head (each group's q, k, then its nv/nk value heads'
v and z; its b's, then its a's), where Qwen3.5 has `in_proj_qkv` (q | k | v, contiguous),
`in_proj_z`, `in_proj_b`, `in_proj_a`. A reader view (`_QkvzAsQwen35`) serves the Qwen3.5 names
as row permutations of the stored tensors, so Qwen3.5-MoE's loader (zero-centred norms,
per-expert keys, `mtp.*`) loads it unchanged, and everything downstream (TP hints on the q|k|v
channels, the fused GDN kernels, recurrent-state rollback) is Qwen3.5's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from specdeploy.checkpoint import CheckpointError, CheckpointReader
from specdeploy.models import qwen3_5_blocks
from specdeploy.models import qwen3_5_moe as q35

ARCHITECTURES = ("Qwen3NextForCausalLM",)
_FROM = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
         "in_proj_a": "in_proj_ba"}


@dataclasses.dataclass(frozen=True)
class Config(qwen3_5_blocks.Config):
    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        text = hf.get("text_config") or hf
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step") or 1) != 1:
            raise ValueError("Qwen3-Next: dense MLP layers (mlp_only_layers / "
                             "decoder_sparse_step) are not supported; every layer is MoE in the "
                             "released models")
        mtp = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0))
        base = qwen3_5_blocks.Config.from_hf({**text, "mtp_num_hidden_layers": mtp or 0})
        return cls(**{**base.__dict__, "mrope_section": None})


class Model(q35.Model):
    """Qwen3.5-MoE's model (its own class: drafter training and MTP heads key on the family)."""


class _QkvzAsQwen35:
    """A checkpoint reader whose GDN projections read under Qwen3.5's names."""

    def __init__(self, reader, cfg: Config):
        self._r, self.path, self.config = reader, reader.path, reader.config
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def _source(self, name: str) -> tuple[str, str] | None:
        if name in self._r:  # (llama.cpp's qwen3next GGUF stores q|k|v and z apart already)
            return None
        parts = name.split(".")
        if len(parts) > 2 and parts[-1] == "weight" and parts[-2] in _FROM:
            return ".".join([*parts[:-2], _FROM[parts[-2]], "weight"]), parts[-2]
        return None

    def __contains__(self, name: str) -> bool:
        src = self._source(name)
        return (src[0] if src else name) in self._r

    def has_prefix(self, prefix: str) -> bool:
        return self._r.has_prefix(prefix)

    def keys(self) -> list[str]:
        out = []
        for k in self._r.keys():
            kind = next((f for f in ("in_proj_qkvz", "in_proj_ba") if k.endswith(f"{f}.weight")),
                        None)
            if kind is None:
                out.append(k)
                continue
            base = k[: -len(f"{kind}.weight")]
            out += [f"{base}{n}.weight" for n, f in _FROM.items() if f == kind]
        return out

    def get(self, name: str) -> torch.Tensor:
        src = self._source(name)
        if src is None:
            return self._r.get(name)
        rows = self._rows(src[1])
        if hasattr(self._r, "get_rows"):  # pre-quantized: the quantized rows go along
            return self._r.get_rows(src[0], rows)
        return self._r.get(src[0])[rows]

    def _rows(self, kind: str) -> torch.Tensor:
        """The stored rows of Qwen3.5's `kind`, in Qwen3.5's order."""
        r = self.nv // self.nk
        if kind in ("in_proj_b", "in_proj_a"):  # per group: its r b's, then its r a's
            start = torch.arange(self.nk)[:, None] * 2 * r + (0 if kind == "in_proj_b" else r)
            return (start + torch.arange(r)).reshape(-1)
        size = 2 * self.dk + 2 * r * self.dv  # per group: q, k, r v's, r z's
        spans = {"q": (0, self.dk), "k": (self.dk, self.dk), "v": (2 * self.dk, r * self.dv),
                 "z": (2 * self.dk + r * self.dv, r * self.dv)}
        parts = "z" if kind == "in_proj_z" else "qkv"
        return torch.cat([(torch.arange(self.nk)[:, None] * size + spans[p][0]
                           + torch.arange(spans[p][1])).reshape(-1) for p in parts])


def checkpoint_to_params(reader: CheckpointReader, cfg: Config, with_mtp: bool = False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name → lazy tensor (Qwen3.5-MoE's loader over the renaming view);
    raises `CheckpointError` naming the checkpoint's own missing keys."""
    try:
        return q35.checkpoint_to_params(_QkvzAsQwen35(reader, cfg), cfg, with_mtp=with_mtp)
    except CheckpointError as e:
        msg = str(e).replace("Qwen3.5-MoE", "Qwen3-Next")
        for ours, theirs in _FROM.items():
            msg = msg.replace(f".{ours}.weight", f".{theirs}.weight")
        raise CheckpointError(msg) from None


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """Our state dict → the released layout: `model.*`, per-expert keys, zero-centred norms,
    the GDN projections grouped per key head."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("inv_freq"):
            continue
        if q35._zero_centred(name):
            t = t.float().sub(1.0).to(t.dtype)
        out.update(q35.per_expert_keys(name, t))
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    r = nv // nk
    for key in [k for k in out if k.endswith("linear_attn.in_proj_qkv.weight")]:
        base = key[: -len("in_proj_qkv.weight")]
        qkv = out.pop(key)
        h = qkv.shape[-1]
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv])
        z = out.pop(f"{base}in_proj_z.weight")
        out[f"{base}in_proj_qkvz.weight"] = torch.cat(
            [q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h),
             z.view(nk, r * dv, h)], 1).reshape(-1, h)
        b, a = out.pop(f"{base}in_proj_b.weight"), out.pop(f"{base}in_proj_a.weight")
        out[f"{base}in_proj_ba.weight"] = torch.cat([b.view(nk, r, h), a.view(nk, r, h)],
                                                    1).reshape(-1, h)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tiny_hf_config(mtp_layers: int = 0) -> dict:
    """A tiny `Qwen3NextForCausalLM` config.json (4 layers: 3 GDN + 1 attention; 2 key heads
    serving 4 value heads, so the per-group layout is exercised)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "partial_rotary_factor": 0.25},
        "mtp_num_hidden_layers": mtp_layers, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, hf_config: dict | None = None
              ) -> Path:
    """A tiny random checkpoint in the released layout (+ `mtp.*` when asked); `hf_config`
    replaces `tiny_hf_config(mtp_layers)` (benches size it up)."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = hf_config or tiny_hf_config(mtp_layers)
    cfg = Config.from_hf(hf)
    model = Model(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)
    q35._random_init(model, torch.Generator().manual_seed(seed))
    write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(out, cfg.vocab_size)
    return Path(out)


__all__ = ["ARCHITECTURES", "Config", "Model", "checkpoint_to_params", "make_tiny",
           "params_to_checkpoint", "tiny_hf_config"]
