"""GGUF architecture "glm4moe" (llama.cpp: GLM-4.5 / 4.6 / 4.7): the Llama layout without the q/k
row permutation (GLM's RoPE is rotate-half: NEOX), q/k/v biases, optional `attn_q_norm` /
`attn_k_norm`, `post_attention_norm`; the leading dense blocks' MLP as `ffn_gate` / `ffn_up` /
`ffn_down`, the MoE blocks' router `ffn_gate_inp` with its selection bias `exp_probs_b.bias`,
routed experts stacked with gate and up apart (joined back into the fused gate_up_proj [E, 2I,
H]), the shared expert `ffn_*_shexp`; the MTP layers as trailing blocks (`nextn_predict_layers`)
with `nextn.{eh_proj, enorm, hnorm, shared_head_norm}` (its `nextn.shared_head_head` /
`nextn.embed_tokens` copies are not read: models/drafters/glm4_moe_mtp.py shares the target's).
llama.cpp stores no routing groups (it routes over all experts): n_group = topk_group = 1, as in
the released GLM-4.5 configs."""
from __future__ import annotations

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, joined_gate_up, table_name

ARCHS = ("glm4moe",)
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{s}": f"self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight"
       for p in ("gate", "up", "down")},
    "nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n_all, nextn = meta.blocks()
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    gate = next((t for name, t in tensors.items() if name.endswith("ffn_gate_exps.weight")),
                None)
    if gate is None:
        raise CheckpointError(f"{reader.path}: a glm4moe GGUF without routed experts "
                              "(ffn_gate_exps)")
    dense = int(get("leading_dense_block_count", 0) or 0)
    dense_ffn = tensors.get("blk.0.ffn_gate.weight")
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": dense_ffn.shape[0] if dense_ffn else int(
            get("feed_forward_length", 0) or 0),
        "num_hidden_layers": n_all - nextn, "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": int(get("rope.dimension_count",
                                                             head_dim // 2)) / head_dim},
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu",
        "n_routed_experts": gate.shape[0], "moe_intermediate_size": gate.shape[1],
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 1) or 1),
        "first_k_dense_replace": dense, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
        "num_nextn_predict_layers": nextn,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def joined(reader) -> dict[str, tuple[list[str], int]]:
    return joined_gate_up(reader, "mlp.experts.gate_up_proj")


def to_hf(gguf_name: str, a, cfg: dict):
    return a
