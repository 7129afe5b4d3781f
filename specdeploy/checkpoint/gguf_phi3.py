"""GGUF architecture "phi3" (llama.cpp's converter `Phi3MiniModel`: Phi-3 / 3.5 / Phi-4 /
Phi-4-mini): the Llama layout with the q/k/v rows in one `attn_qkv` and gate | up in one
`ffn_up` (as transformers' `qkv_proj` / `gate_up_proj`; models/phi3.py splits them), no q/k row
permutation (NEOX RoPE: rotate-half), `rope.dimension_count` rotary dims of each head (partial
RoPE), and LongRoPE as two tensors, `rope_factors_long` / `rope_factors_short`, with
`rope.scaling.attn_factor` and `rope.scaling.original_context_length`. `attention.sliding_window`
0 means none (the converter writes 0 for Phi-4, whose config has none)."""
from __future__ import annotations

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, table_name

ARCHS = ("phi3",)
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "attn_qkv.weight": "self_attn.qkv_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "ffn_up.weight": "mlp.gate_up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = hidden // heads
    rot = int(get("rope.dimension_count", head_dim))
    ctx = int(get("context_length", 4096))
    orig = int(get("rope.scaling.original_context_length", ctx))
    window = int(get("attention.sliding_window", 0) or 0)
    cfg = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rot / head_dim,
        "max_position_embeddings": ctx, "original_max_position_embeddings": orig,
        "sliding_window": window or None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    present = [n for n in names if n in tensors]
    if present:
        if len(present) != 2:
            raise CheckpointError(f"{reader.path}: a phi3 GGUF with {present[0]} alone (LongRoPE "
                                  "needs both rope_factors_long and rope_factors_short)")
        long, short = (reader.dequantize(n).reshape(-1).tolist() for n in names)
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": long,
                               "short_factor": short}
        att = get("rope.scaling.attn_factor")
        if att is not None:
            cfg["rope_scaling"]["attention_factor"] = float(att)
    return cfg


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def to_hf(gguf_name: str, a, cfg: dict):
    return a
