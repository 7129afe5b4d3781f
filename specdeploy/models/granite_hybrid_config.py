"""Granite 4.0's configuration from a Hugging Face config.json (models/granite_hybrid.py): the
layer kinds, Granite's scalar multipliers, and the Mamba2 mixer's fields under NemotronH's names
(`Mamba2Mixer` reads them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdeploy.models.layers import RopeConfig
from specdeploy.models.nemotron_h_config import _float

_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
          "full_attention": "attention"}


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    block_types: tuple[str, ...]  # "mamba" | "attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    eps: float
    rope: RopeConfig | None  # None: no positional encoding (NoPE)
    attention_bias: bool = False
    attention_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0  # each routed expert's width
    shared_intermediate_size: int = 0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    # the Mamba2 mixer's fields under NemotronH's names (Mamba2Mixer reads them)
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 256
    n_groups: int = 1
    chunk_size: int = 256
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = math.inf

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        n, h = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
        types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n
        unknown = sorted(set(types) - set(_KINDS))
        if unknown:
            raise ValueError(f"Granite 4.0: layer types {unknown} are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Granite 4.0: hidden_act {hf['hidden_act']!r} is not supported")
        pos = hf.get("position_embedding_type")
        if pos not in (None, "nope", "rope"):
            raise ValueError(f"Granite 4.0: position_embedding_type {pos!r} is not supported")
        heads_ = int(hf["num_attention_heads"])
        m_heads = int(hf.get("mamba_n_heads", 128))
        d_head = hf.get("mamba_d_head", "auto")
        d_head = int(hf.get("mamba_expand", 2)) * h // m_heads if d_head == "auto" else int(d_head)
        lo, hi = hf.get("time_step_limit") or (0.0, math.inf)
        return cls(
            vocab_size=int(hf["vocab_size"]), hidden_size=h, num_hidden_layers=n,
            block_types=tuple(_KINDS[t] for t in types[:n]), num_attention_heads=heads_,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads_),
            head_dim=int(hf.get("head_dim") or h // heads_),
            eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf) if pos == "rope" else None,
            attention_bias=bool(hf.get("attention_bias", False)),
            **{k: float(hf.get(k) or 1.0) for k in ("attention_multiplier",
                                                    "embedding_multiplier",
                                                    "residual_multiplier", "logits_scaling")},
            num_local_experts=int(hf.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            intermediate_size=int(hf.get("intermediate_size") or 0),
            shared_intermediate_size=int(hf.get("shared_intermediate_size") or 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            mamba_num_heads=m_heads, mamba_head_dim=d_head,
            ssm_state_size=int(hf.get("mamba_d_state", 256)),
            n_groups=int(hf.get("mamba_n_groups", 1)),
            chunk_size=int(hf.get("mamba_chunk_size", 256)),
            conv_kernel=int(hf.get("mamba_d_conv", 4)),
            use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            use_bias=bool(hf.get("mamba_proj_bias", False)), dt_min=_float(lo),
            dt_max=_float(hi))
