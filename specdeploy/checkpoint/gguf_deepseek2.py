"""GGUF architecture "deepseek2" (llama.cpp: DeepSeek-V2 / V2-Lite / V3 / R1, Kimi K2), as
llama.cpp's converter writes it (conversion/deepseek.py `DeepseekV2Model`): the MLA projections
under their own names (`attn_q_a` / `attn_q_a_norm` / `attn_q_b` or `attn_q`, `attn_kv_a_mqa`,
`attn_kv_a_norm`), `kv_b_proj` split per head into `attn_k_b` (k_nope's rows, transposed: [H,
kv_lora_rank, qk_nope]) and `attn_v_b` ([H, v, kv_lora_rank]) for llama.cpp's absorbed MLA, or
whole as `attn_kv_b` (older converters); no RoPE row permutation (llama.cpp rotates DeepSeek's
interleaved pairs as stored); GLM-4.5's MoE names (`ffn_gate_inp`, `exp_probs_b.bias`, stacked
experts, `ffn_*_shexp`). The converter drops the MTP layers.

Routing: sigmoid gating (V3 / Kimi K2) is `DeepseekV3ForCausalLM`; softmax gating (V2, also
what an older file without `expert_gating_func` means) is `DeepseekV2ForCausalLM`, group-limited
where it has routing groups (as V2's config). YaRN: the file keeps mscale_all_dim only (as
`yarn_log_multiplier` = 0.1 mscale_all_dim); mscale is taken equal to it, as llama.cpp does
(every DeepSeek / Kimi release has them equal: the attention factor of cos / sin is then 1).
"""
from __future__ import annotations

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import BLK, ArchMeta, joined_gate_up, table_name

ARCHS = ("deepseek2",)
ROTARY_PERMUTED = False
BLOCKS_JOIN_DIM = 1  # (the experts' gate | up: whole block rows; kv_b has no blocks, see below)
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's expert_gating_func
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight"
       for p in ("gate", "up", "down")},
}


def _yarn(meta: ArchMeta) -> dict | None:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise CheckpointError(f"{meta.path}: deepseek2 GGUF with rope scaling {kind!r} "
                              "(supported: yarn, none)")
    out = {"type": "yarn", "factor": float(meta.need("rope.scaling.factor")),
           "original_max_position_embeddings": int(meta.need(
               "rope.scaling.original_context_length")),
           "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
           "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0))}
    log_mul = meta.get("rope.scaling.yarn_log_multiplier")
    if log_mul:
        m = round(float(log_mul) / 0.1, 6)  # (stored as f32: 0.1 x 0.707 -> 0.707)
        out.update(mscale=m, mscale_all_dim=m)
    return out


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    gate = next((t for name, t in tensors.items() if name.endswith("ffn_gate_exps.weight")),
                None)
    if gate is None:
        raise CheckpointError(f"{reader.path}: a deepseek2 GGUF without routed experts "
                              "(ffn_gate_exps)")
    gating = int(get("expert_gating_func", _SOFTMAX))
    if gating not in (_SOFTMAX, _SIGMOID):
        raise CheckpointError(f"{reader.path}: deepseek2 GGUF expert_gating_func {gating} "
                              "(supported: 1 softmax, 2 sigmoid)")
    groups = int(get("expert_group_count", 1) or 1)
    rope_dim = int(need("rope.dimension_count"))
    nope = int(need("attention.key_length_mla")) - rope_dim
    dense_ffn = tensors.get("blk.0.ffn_gate.weight")
    heads = int(need("attention.head_count"))
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM" if gating == _SIGMOID
                          else "DeepseekV2ForCausalLM"],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": dense_ffn.shape[0] if dense_ffn else int(
            get("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": heads,  # (the file's 1 is llama.cpp's MQA view of the latent)
        "q_lora_rank": int(get("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(need("attention.kv_lora_rank")), "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim, "v_head_dim": int(need("attention.value_length_mla")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_scaling": _yarn(meta),
        "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu",
        "n_routed_experts": gate.shape[0], "moe_intermediate_size": gate.shape[1],
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0) or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0) or 0),
        "n_group": groups, "topk_group": int(get("expert_group_used_count", groups) or groups),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
        "num_nextn_predict_layers": 0,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if gating == _SOFTMAX:
        cfg.update(scoring_func="softmax",
                   topk_method="group_limited_greedy" if groups > 1 else "greedy")
    return cfg


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def joined(reader) -> dict[str, tuple[list[str], int]]:
    out = joined_gate_up(reader, "mlp.experts.gate_up_proj")
    for name in reader.tensor_infos:
        m = BLK.match(name)
        v_b = f"blk.{m.group(1)}.attn_v_b.weight" if m else None
        if m and m.group(2) == "attn_k_b.weight" and v_b in reader.tensor_infos:
            out[f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight"] = ([name, v_b], 1)
    return out


def to_hf(gguf_name: str, a, cfg: dict):
    if gguf_name.endswith("attn_k_b.weight"):  # [H, kv_lora_rank, nope] -> [H, nope, rank]
        return a.swapaxes(1, 2)
    return a


def join(name: str, arrays: list) -> np.ndarray:
    """kv_b_proj: each head's k_nope rows, then its v rows, as [H (nope + v), kv_lora_rank]; the
    experts' gate | up: concatenated (gate rows first)."""
    out = np.concatenate(arrays, 1)
    return out.reshape(-1, out.shape[-1]) if name.endswith("kv_b_proj.weight") else out


def blocks_hf(gguf_name: str, raw, cfg: dict):
    """Whole block rows of each tensor as stored, except attn_k_b: transposed (a block spans
    its stored rows' columns), so kv_b_proj computes from its values."""
    return None if gguf_name.endswith("attn_k_b.weight") else raw
