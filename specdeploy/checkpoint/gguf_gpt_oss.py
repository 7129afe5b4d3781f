"""GGUF architecture "gpt-oss" (llama.cpp's converter `GptOssModel`, runtime `openai-moe`): the
Llama layout without the q/k row permutation (NEOX RoPE: rotate-half), biases on q/k/v/o,
`attn_sinks.weight`, `post_attention_norm`, the router `ffn_gate_inp` (weight and bias), and
the experts stacked with gate and up apart: `ffn_{gate,up}_exps.{weight,bias}` [E, I, H] /
[E, I] (the even / odd columns of transformers' interleaved `gate_up_proj`), `ffn_down_exps`
[E, H, I]. The released MXFP4 experts stay MXFP4 there (ggml type 39: per 32 values one E8M0
byte e and 16 bytes, byte j holding element j (low nibble) and j + 16, values ±{0, 1, 2, 3, 4,
6, 8, 12} x 2^(e - 128), E2M1 doubled); gguf-py dequantizes them exactly (what `get` returns),
and `get_blocks` gives those blocks as they are (checkpoint/gguf_mxfp4.py) to the CPU's block
kernels (deploy/passes/ggml_experts.py).

Not in the file, so taken as the releases have them: the clamped SwiGLU's alpha 1.702 and limit
7 (llama.cpp hard-codes both), YaRN's `truncate: false` (every gpt-oss config; NOTE: llama.cpp's
runtime always floors / ceils the ramp's ends, so its RoPE differs slightly from transformers'
and ours), and the layer types: sliding first, then alternating (llama.cpp's pattern 2), unless
the file's `attention.sliding_window_pattern` says otherwise."""
from __future__ import annotations

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import BLK, ArchMeta, table_name

ARCHS = ("gpt-oss",)
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{s}": f"self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias")},
    **{f"attn_output.{s}": f"self_attn.o_proj.{s}" for s in ("weight", "bias")},
    "attn_sinks.weight": "self_attn.sinks",
    **{f"ffn_gate_inp.{s}": f"mlp.router.{s}" for s in ("weight", "bias")},
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}


def _layer_types(meta: ArchMeta, n: int) -> list[str]:
    pattern = meta.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple, np.ndarray)):
        swa = [bool(p) for p in pattern][:n]
    else:  # llama.cpp: layer i slides where i % pattern < pattern - 1
        swa = [i % int(pattern) < int(pattern) - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n = int(need("block_count"))
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    if gate is None:
        raise CheckpointError(f"{reader.path}: a gpt-oss GGUF without routed experts "
                              "(blk.0.ffn_gate_exps.weight)")
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 150000.0))}
    if get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(need("rope.scaling.factor")),
                    original_max_position_embeddings=int(need(
                        "rope.scaling.original_context_length")),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
        if get("rope.scaling.yarn_attn_factor") is not None:
            rope["attention_factor"] = float(get("rope.scaling.yarn_attn_factor"))
    elif get("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{reader.path}: gpt-oss GGUF with rope scaling "
                              f"{get('rope.scaling.type')!r} (supported: yarn, none)")
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": int(get("expert_feed_forward_length", gate.shape[1])),
        "num_hidden_layers": n, "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 131072)),
        "rope_parameters": rope, "attention_bias": True,
        "sliding_window": int(need("attention.sliding_window")),
        "layer_types": _layer_types(meta, n),
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_local_experts": gate.shape[0], "num_experts_per_tok": int(need("expert_used_count")),
        "swiglu_limit": 7.0,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def joined(reader) -> dict[str, tuple[list[str], int]]:
    """transformers' `gate_up_proj` [E, H, 2I] and `gate_up_proj_bias` [E, 2I] of each block,
    from the gate and up halves (interleaved back by `join`)."""
    out = {}
    for name in reader.tensor_infos:
        m = BLK.match(name)
        if m and m.group(2) in ("ffn_gate_exps.weight", "ffn_gate_exps.bias"):
            up = name.replace("ffn_gate_exps", "ffn_up_exps")
            if up in reader.tensor_infos:
                leaf = "gate_up_proj" + ("_bias" if name.endswith(".bias") else "")
                out[f"model.layers.{m.group(1)}.mlp.experts.{leaf}"] = ([name, up], -1)
    return out


def join(hf: str, parts: list[np.ndarray]) -> np.ndarray:
    """Gate and up (after `to_hf`: [E, H, I] / [E, I]) as transformers' interleaved columns:
    gate at the even ones, up at the odd ones."""
    gate, up = parts
    return np.stack((gate, up), -1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def to_hf(gguf_name: str, a, cfg: dict):
    """Expert matrices back to transformers' [E, in, out] layout."""
    if gguf_name.endswith(("_exps.weight",)):
        return np.swapaxes(a, 1, 2)
    return a


# The experts' blocks: stored [E, N, K] as the module's parameters are (gate_up_proj [E, 2I, H]
# gate rows first: the gate and up tensors' rows joined on dim 1; down_proj [E, H, I]).
BLOCKS_JOIN_DIM = 1
