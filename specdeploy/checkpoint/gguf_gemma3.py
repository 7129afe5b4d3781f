"""GGUF architecture "gemma3" (llama.cpp's converter `Gemma3Model`, for Gemma3ForCausalLM and the
language model of Gemma3ForConditionalGeneration): the Llama names without the q/k row
permutation (NEOX RoPE: rotate-half), plus `attn_{q,k}_norm`, `post_attention_norm`,
`ffn_norm` (the pre-feedforward norm) and `post_ffw_norm`. The converter stores every RMSNorm
weight with its 1 added (transformers' Gemma3RMSNorm scales by `1 + w`); `to_hf` takes it off in
float64, exactly, so the family adds it back to the same fp32 value. (The converter upcasts a
bf16 release to fp32 before adding the 1 and keeps norms F32: the file holds fp32's `1 + w`, the
value the safetensors path computes.)

Not in the file, so taken as llama.cpp's runtime (src/models/gemma3.cpp) takes them: the score
scale (`query_pre_attn_scalar`: hidden / heads for the 62-layer 27B, else head_dim, as
gemma_pytorch), the layer types (every 6th layer full unless `attention.sliding_window_pattern`
says otherwise; no `attention.sliding_window`: all full), the sliding layers' RoPE base
(`rope.freq_base_swa`, else 10^4) and that linear rope scaling applies to the full layers only.
The converter also cuts `token_embd` to the tokenizer's vocabulary: the vocabulary is its rows.
"""
from __future__ import annotations

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, table_name

ARCHS = ("gemma3",)
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def _layer_types(meta: ArchMeta, n: int) -> list[str]:
    if not meta.get("attention.sliding_window"):
        return ["full_attention"] * n
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple, np.ndarray)):
        swa = [bool(p) for p in pattern][:n]
    else:  # llama.cpp: layer i slides where i % pattern < pattern - 1 (pattern 0: all)
        p = int(pattern)
        swa = [p == 0 or i % p < p - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n = int(need("block_count"))
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    head_dim = int(get("attention.key_length", 256))
    full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(need("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise CheckpointError(f"{reader.path}: gemma3 GGUF with rope scaling {scaling!r} "
                              "(supported: linear, none)")
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": n,
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv",
                                                                    heads)),
        "head_dim": head_dim, "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 131072)),
        "query_pre_attn_scalar": hidden // heads if n == 62 else head_dim,
        "sliding_window": int(get("attention.sliding_window", 0) or 0) or None,
        "layer_types": _layer_types(meta, n),
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10_000.0))}},
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def to_hf(gguf_name: str, a, cfg: dict):
    """Norm weights as transformers stores them (`w`, not `1 + w`): float64, where the
    subtraction is exact."""
    if gguf_name.endswith("norm.weight"):
        return a.astype(np.float64) - 1.0
    return a
