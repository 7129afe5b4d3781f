"""GGUF architecture "llama" (llama.cpp): its metadata as a Hugging Face Llama config, its
tensor names as HF names. llama.cpp's converter permutes the rows of q/k projections for its
interleaved RoPE (`ROTARY_PERMUTED`); the reader undoes it."""
from __future__ import annotations

import re

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta

ROTARY_PERMUTED = True
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, cfg: dict | None = None) -> str | None:
    """HF tensor name of a llama.cpp one, or None when it has no HF counterpart."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_config(reader, arch: str = "llama", dense_ffn: bool = True) -> dict:
    """`reader`: a `GGUFReader` (its `metadata`, tensor table and `path`); `arch`: the metadata's
    key prefix (gguf_qwen.py reads Qwen2 / Qwen3 files through this); `dense_ffn` False: the
    dense MLP's width may be absent (0: a model of MoE layers)."""
    md, tensors = reader.metadata, reader.tensor_infos
    meta = ArchMeta(reader, arch)
    get, need = meta.get, meta.need

    heads = int(need("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer arrays: llama has one value throughout
        kv_heads = kv_heads[0]
    hidden = int(need("embedding_length"))
    embd = tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd else get("vocab_size") or len(
        md.get("tokenizer.ggml.tokens", ()))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length") if dense_ffn
                                 else get("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(get("rope.scaling.factor", 1.0))}
    elif get("rope.scaling.type") == "yarn":  # (llama.cpp's converter: Qwen2.5 / Qwen3 YaRN)
        cfg["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
        if get("rope.scaling.yarn_attn_factor") is not None:
            cfg["rope_scaling"]["attention_factor"] = float(get("rope.scaling.yarn_attn_factor"))
    elif get("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{reader.path}: unsupported rope scaling "
                              f"{get('rope.scaling.type')!r}")
    if "rope_freqs.weight" in tensors:  # llama3-style scaling, as per-frequency divisors
        factors = reader.dequantize("rope_freqs.weight").tolist()
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                  "freq_factors": factors}
    return cfg


def to_hf(gguf_name: str, a, cfg: dict):
    """A tensor's values in the HF layout (llama: as stored, but for the q/k permutation)."""
    return a
