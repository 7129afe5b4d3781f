"""Typed validation of the config.json keys the loaders read, before any model code sees them.

The family `from_hf` functions convert with `int(...)` / `float(...)`, which turns
`hidden_size: 64.5` into 64 and `num_hidden_layers: "2"` into 2, and fails untyped on
`rope_theta: null`. Here every key we read has one expected type; a mismatch is a
`CheckpointError` naming the key, the expected type and the value. Keys we do not read are
left alone (HF configs carry many). `null` is accepted only where HF itself uses it for "unset".
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from specdeploy.checkpoint.errors import CheckpointError


def _int(lo: int) -> tuple[str, Callable[[Any], bool]]:
    return (f"an integer >= {lo}",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


POS_INT = _int(1)
NONNEG_INT = _int(0)
POS_FLOAT = ("a finite number > 0", lambda v: _num(v) and math.isfinite(v) and v > 0)
FRACTION = ("a number in (0, 1]", lambda v: _num(v) and 0 < v <= 1)
BOOL = ("true or false", lambda v: isinstance(v, bool))
STR = ("a string", lambda v: isinstance(v, str))
DICT = ("an object", lambda v: isinstance(v, dict))
STR_LIST = ("a list of strings", lambda v: isinstance(v, list)
            and all(isinstance(x, str) for x in v))
# transformers 5 writes inf as {"__float__": "Infinity"}
LIMITS = ("a list of two numbers", lambda v: isinstance(v, list) and len(v) == 2 and all(
    _num(x) or (isinstance(x, dict) and set(x) == {"__float__"}) for x in v))
TOKEN_IDS = ("a token id (integer >= 0) or a list of them", lambda v: NONNEG_INT[1](v) or (
    isinstance(v, list) and bool(v) and all(NONNEG_INT[1](x) for x in v)))

_POS_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "max_position_embeddings", "draft_vocab_size", "moe_intermediate_size",
    "linear_value_head_dim", "linear_num_value_heads",
    "linear_num_key_heads", "linear_key_head_dim", "linear_conv_kernel_dim",
    "full_attention_interval", "patch_size", "temporal_patch_size", "spatial_merge_size",
    "in_channels", "depth", "out_hidden_size", "num_position_embeddings")
# key -> (expectation, check, null allowed)
SCHEMA: dict[str, tuple[str, Callable[[Any], bool], bool]] = {
    **{k: (*POS_INT, False) for k in _POS_INTS},
    # (null: the default; speculators' EAGLE-3 configs write target_hidden_size null)
    **{k: (*POS_INT, True) for k in ("num_key_value_heads", "head_dim", "target_hidden_size")},
    "sliding_window": (*NONNEG_INT, True),  # (0: none, as transformers writes Qwen2-MoE's)
    # (0 experts per token: dense Granite 4.0 configs write it)
    **{k: (*NONNEG_INT, False) for k in ("mtp_num_hidden_layers", "num_experts",
                                         "num_experts_per_tok",
                                         "shared_expert_intermediate_size")},
    **{k: (*POS_FLOAT, False) for k in ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")},
    "partial_rotary_factor": (*FRACTION, False),
    **{k: (*BOOL, False) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias",
                                   "norm_topk_prob", "norm_zero_centered",
                                   "norm_before_residual")},
    "hidden_act": (*STR, False),
    **{k: (*STR_LIST, False) for k in ("architectures", "layer_types")},
    **{k: (*LIMITS, False) for k in ("time_step_limit", "mamba_dt_limit")},
    **{k: (*DICT, True) for k in ("rope_scaling", "rope_parameters", "eagle_config",
                                  "quantization_config")},
    "eos_token_id": (*TOKEN_IDS, True),
    "bos_token_id": (*NONNEG_INT, True),
}
# validated with the same schema (transformer_layer_config: a speculators drafter's layer)
NESTED = ("text_config", "vision_config", "transformer_layer_config")


def validate_hf_config(cfg: Any, source: str, prefix: str = "") -> None:
    """Raise CheckpointError for the first key of `cfg` (config.json) with a wrong type."""
    if not isinstance(cfg, dict):
        what = f"key {prefix.rstrip('.')!r}" if prefix else "config.json"
        raise CheckpointError(f"{source}: {what}: expected a JSON object, got "
                              f"{type(cfg).__name__} {_show(cfg)}")
    for key, (expect, ok, nullable) in SCHEMA.items():
        if key not in cfg:
            continue
        v = cfg[key]
        if (v is None and not nullable) or (v is not None and not ok(v)):
            raise CheckpointError(f"{source}: config.json key {prefix + key!r}: expected "
                                  f"{expect}{' or null' if nullable else ''}, got {_show(v)}")
    for key in NESTED:
        if cfg.get(key) is not None:
            validate_hf_config(cfg[key], source, f"{prefix}{key}.")


def _show(v: Any) -> str:
    import json

    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
