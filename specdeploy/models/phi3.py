"""Microsoft Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): the Llama layer with the q/k/v
projections stored as one `qkv_proj` ([q; k; v] rows) and gate / up as one `gate_up_proj`
([gate; up] rows), split at load into Llama's parameters (so the fused-projection passes, the
C kernels and the TP hints apply as to Llama); partial RoPE (`partial_rotary_factor`, Phi-4-mini:
0.75 of each head, rotate-half on the first dims); a sliding window on every layer where
`sliding_window` is set (transformers masks every layer with it); and LongRoPE (`rope_type
"longrope"`, Phi-3.5 / Phi-4-mini): per-frequency divisors, `short_factor` or `long_factor`,
and cos / sin times an attention factor.

LongRoPE's choice: transformers takes the long factors for a whole forward whose largest
position is past `original_max_position_embeddings`, the short ones otherwise (and keeps the
cached keys as they were). Here a token at a position below that bound takes the short factors
and one at or above it the long ones (vLLM likewise switches at that bound): the same numbers as
transformers for every sequence within the original context, which a test checks, and for a
whole prompt past it the long factors apply there (beyond the bound both tools differ from
transformers' recomputing)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.reader import RowSlice, from_keys
from specdeploy.models import llama
from specdeploy.ops.rope import RopeCosSin, rope_cos_sin

ARCHITECTURES = ("Phi3ForCausalLM",)


@dataclass(frozen=True)
class LongRope:
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @classmethod
    def from_params(cls, params: dict, hf: dict, rotary_dim: int) -> LongRope:
        orig = params.get("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings"))
        if not orig:
            raise ValueError("phi3: longrope needs original_max_position_embeddings")
        short, long = params.get("short_factor"), params.get("long_factor")
        for name, f in (("short_factor", short), ("long_factor", long)):
            if not isinstance(f, (list, tuple)) or len(f) != rotary_dim // 2:
                raise ValueError(f"phi3: longrope {name} must be a list of {rotary_dim // 2} "
                                 f"numbers (rotary dim {rotary_dim}), got {f!r}")
        factor = params.get("factor")
        factor = float(factor) if factor is not None else (
            int(hf.get("max_position_embeddings", orig)) / int(orig))
        att = params.get("attention_factor")
        if att is None:  # the LongRoPE paper's, as transformers computes it
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
        return cls(tuple(float(x) for x in short), tuple(float(x) for x in long), int(orig),
                   float(att))


@dataclass(frozen=True)
class Config(llama.Config):
    partial_rotary_factor: float = 1.0
    longrope: LongRope | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = dict(hf.get("text_config") or hf)
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ("su", "yarn"):  # transformers' Phi3Config reads both as longrope
            kind = "longrope"
        if kind not in ("default", "longrope"):
            raise ValueError(f"phi3: unsupported rope type {kind!r}; supported: default, "
                             "longrope")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                   1.0)))
        base = dict(hf, model_type="phi3", rope_parameters={"rope_theta": theta},
                    rope_scaling=None)
        window = hf.get("sliding_window")
        if window and not hf.get("layer_types"):  # every layer (transformers' Phi3 mask)
            base["layer_types"] = ["sliding_attention"] * int(hf["num_hidden_layers"])
        cfg = llama.Config.from_hf(base)
        out = cls(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                  partial_rotary_factor=partial)
        if out.rotary_dim % 2 or not 0 < out.rotary_dim <= out.head_dim:
            raise ValueError(f"phi3: partial_rotary_factor {partial} gives rotary dim "
                             f"{out.rotary_dim} of head dim {out.head_dim}")
        if kind == "longrope":
            out = replace(out, longrope=LongRope.from_params(params, hf, out.rotary_dim))
        return out


class LongRopeEmbedding(nn.Module):
    """cos / sin per position: the short factors' below the original context, the long
    factors' from it on (see the module docstring), both times the attention factor."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.theta, self.rotary_dim, self.lr = cfg.rope.theta, cfg.rotary_dim, cfg.longrope
        self.init_buffers()

    def _inv(self, factors: tuple[float, ...]) -> torch.Tensor:
        # (transformers' float steps: 1 / (ext * base ** (arange(0, dim, 2) / dim)))
        shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64,
                             device="cpu").float() / self.rotary_dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu")
                      * self.theta ** shape)

    def init_buffers(self) -> None:
        self.register_buffer("inv_short", self._inv(self.lr.short_factor), persistent=False)
        self.register_buffer("inv_long", self._inv(self.lr.long_factor), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> RopeCosSin:
        s = self.lr.attention_factor
        short = rope_cos_sin(position_ids, self.inv_short, attention_scaling=s)
        long = rope_cos_sin(position_ids, self.inv_long, attention_scaling=s)
        far = (position_ids >= self.lr.original_max_position_embeddings)[..., None]
        return RopeCosSin(torch.where(far, long.cos, short.cos),
                          torch.where(far, long.sin, short.sin))


class Model(llama.Model):
    def __init__(self, cfg: Config, with_mtp: bool = False):
        super().__init__(cfg, with_mtp)
        if cfg.longrope is not None:
            self.model.rotary_emb = LongRopeEmbedding(cfg)


def checkpoint_to_params(reader, cfg: Config, with_mtp: bool = False):
    """Llama's parameters from Phi-3's fused tensors (rows split; everything else one to one)."""
    if with_mtp:
        raise CheckpointError("Phi-3 checkpoints have no MTP weights")
    d, hq, hkv, i = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    with torch.device("meta"):
        names = [n for n, _ in Model(cfg).named_parameters()]
    params, missing = {}, []
    splits = {"q_proj": ("self_attn.qkv_proj", 0, hq * d),
              "k_proj": ("self_attn.qkv_proj", hq * d, (hq + hkv) * d),
              "v_proj": ("self_attn.qkv_proj", (hq + hkv) * d, (hq + 2 * hkv) * d),
              "gate_proj": ("mlp.gate_up_proj", 0, i), "up_proj": ("mlp.gate_up_proj", i, 2 * i)}
    for name in names:
        parts = name.split(".")
        if len(parts) == 6 and parts[1] == "layers" and parts[4] in splits:
            fused, a, b = splits[parts[4]]
            src = f"model.layers.{parts[2]}.{fused}.weight"
            if src not in reader:
                missing.append(src)
            else:
                # (GGUF: the rows' blocks, loading.py, not fp32 values)
                params[name] = from_keys(lambda src=src, a=a, b=b: _rows(reader, src, a, b),
                                         RowSlice(src, a, b))
        elif name in reader:
            params[name] = lambda src=name: reader.get(src)
        else:
            missing.append(name)
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(f"{reader.path}: Phi-3 tensors are missing: "
                              f"{', '.join(sorted(set(missing))[:12])}{more}")
    return params


def _rows(reader, src: str, a: int, b: int) -> torch.Tensor:
    t = reader.get(src)
    if t.shape[0] < b:
        raise CheckpointError(f"{reader.path}: {src} has {t.shape[0]} rows; the config needs "
                              f"{b}")
    return t[a:b].contiguous()


def params_to_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Config
                         ) -> dict[str, torch.Tensor]:
    """transformers' layout: q/k/v and gate/up joined again."""
    out = llama.params_to_checkpoint(
        {k: v for k, v in state_dict.items() if "inv_" not in k}, cfg)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [out.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [out.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    return out


def tiny_hf_config(mtp_layers: int = 0, **overrides) -> dict:
    if mtp_layers:
        raise ValueError("Phi-3 has no MTP layers")
    cfg = llama.tiny_hf_config(
        architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0,
        original_max_position_embeddings=512, sliding_window=None)
    cfg.update(overrides)
    return cfg


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0, *,
              config_overrides: dict | None = None) -> Path:
    """A random tiny Phi-3 checkpoint (config, safetensors, tokenizer) at `out`."""
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    hf = tiny_hf_config(mtp_layers, **(config_overrides or {}))
    cfg = Config.from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    path = write_checkpoint(out, hf, params_to_checkpoint(model.state_dict(), cfg))
    write_tiny_tokenizer(path, cfg.vocab_size)
    return path
