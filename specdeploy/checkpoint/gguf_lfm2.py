"""GGUF architecture "lfm2" (llama.cpp: Liquid AI LFM2, conversion/lfm2.py `LFM2Model`; runtime
src/models/lfm2.cpp): its metadata as a Hugging Face `Lfm2ForCausalLM` config, its tensors under
the released names.

What the converter changes, undone here:
- the short conv's weight [H, 1, L] is stored without its middle axis (`shortconv.conv`);
- layer kinds are not stored as such (llama.cpp reads a conv layer from `head_count_kv` 0):
  read from the tensors a block holds (`shortconv.in_proj` conv, `attn_q` attention);
- `feed_forward_length` is the FFN width *after* transformers' auto-adjustment, so the config
  says `block_auto_adjust_ff_dim: false`;
- the final norm (`model.embedding_norm`) is `token_embd_norm` (llama.cpp's own name for it).
q / k rows are not permuted (`LFM2Model` is a TextModel: RoPE in llama.cpp's NEOX order).
"""
from __future__ import annotations

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, table_name

ARCHS = ("lfm2",)
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "token_embd_norm.weight": "model.embedding_norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    **{f"shortconv.{p}.{s}": f"conv.{p}.{s}" for p in ("conv", "in_proj", "out_proj")
       for s in ("weight", "bias")},
    **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"},
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight", "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n = int(need("block_count"))
    types = []
    for i in range(n):
        if f"blk.{i}.shortconv.in_proj.weight" in tensors:
            types.append("conv")
        elif f"blk.{i}.attn_q.weight" in tensors:
            types.append("full_attention")
        else:
            raise CheckpointError(f"{reader.path}: GGUF block {i} holds neither a short conv "
                                  "(shortconv.in_proj) nor attention (attn_q)")
    if int(get("attention.sliding_window", 0) or 0) > 0:  # (not in transformers' LFM2)
        raise CheckpointError(f"{reader.path}: lfm2.attention.sliding_window="
                              f"{get('attention.sliding_window')} is not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    kv = max(kv) if isinstance(kv, list) else int(kv)  # (0 on the conv layers)
    conv = types.index("conv") if "conv" in types else None
    return {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "num_hidden_layers": n, "layer_types": types, "num_attention_heads": heads,
        "num_key_value_heads": kv or heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "intermediate_size": int(need("feed_forward_length")),
        "block_auto_adjust_ff_dim": False,
        "conv_L_cache": int(need("shortconv.l_cache")),
        "conv_bias": conv is not None and f"blk.{conv}.shortconv.conv.bias" in tensors,
        "norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        # (llama.cpp's fallback where the file has no base; the converter always writes it)
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 128000)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def to_hf(gguf_name: str, a, cfg: dict):
    if gguf_name.endswith("shortconv.conv.weight"):
        return a[:, None, :]  # [H, L] -> nn.Conv1d's [H, 1, L]
    return a
