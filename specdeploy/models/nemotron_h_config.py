"""NemotronH's configuration from a Hugging Face config.json (models/nemotron_h.py): block types
from `hybrid_override_pattern` or the layer-type lists, the legacy Mamba key names, and
transformers' defaults."""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_HF_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
             "attention": "attention", "mlp": "mlp", "moe": "moe"}
_LEGACY = {"n_groups": "mamba_n_groups", "chunk_size": "mamba_chunk_size",
           "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias"}


def _types(hf: dict, list_key: str, pattern_key: str, default: str) -> tuple[str, ...]:
    if hf.get(list_key):
        return tuple(_HF_TYPES[t] for t in hf[list_key])
    return tuple(_PATTERN[c] for c in (hf.get(pattern_key) or default))


def _float(v) -> float:
    """transformers' save_pretrained writes inf as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    block_types: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe" per layer
    mtp_block_types: tuple[str, ...]  # one MTP group, e.g. ("attention", "moe")
    eps: float
    dt_min: float
    dt_max: float
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    # The rest keep their HF names; the defaults are transformers'.
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    chunk_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    num_attention_heads: int = 32
    attention_bias: bool = False
    intermediate_size: int = 0
    mlp_bias: bool = False
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = {**hf, **hf.get("text_config", {})}
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if hf.get(key, want) != want:
                raise ValueError(f"NemotronH: {key}={hf[key]!r} is not supported (only {want!r})")
        f = {x.name: hf.get(x.name, hf.get(_LEGACY.get(x.name, ""), x.default))
             for x in fields(cls) if x.default is not MISSING}
        lo, hi = hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, math.inf)))
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            block_types=_types(hf, "layers_block_type", "hybrid_override_pattern", "M*E-"),
            mtp_block_types=_types(hf, "mtp_layers_block_type", "mtp_hybrid_override_pattern",
                                   "*E"),
            eps=hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-5)),
            dt_min=_float(lo), dt_max=_float(hi),
            num_key_value_heads=hf.get("num_key_value_heads") or f["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // f["num_attention_heads"],
            sliding_window=hf.get("sliding_window") or 0, **f)
