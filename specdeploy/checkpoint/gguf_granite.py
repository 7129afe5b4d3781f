"""GGUF architecture "granitehybrid" (llama.cpp: IBM Granite 4.0-H, models/granite_hybrid.py):
its metadata as a Hugging Face GraniteMoeHybrid config, its tensors under the released names.

What llama.cpp's converter changes, undone here (conversion/granite.py `GraniteHybridModel`):
- layer kinds are not stored (read from the tensors a block holds: `ssm_in` Mamba2,
  `attn_q` attention); the Mamba2 tensors as NemotronH's (gguf_nemotron_h.py `to_hf`: A as
  -exp(A_log), D and the grouped norm reshaped, the conv weight without its middle axis);
- q/k projection rows are permuted as for llama's interleaved RoPE (undone; the hybrid has no
  RoPE: llama.cpp runs it only where `rope.scaling.finetuned` says so, as the converter writes
  for Bamba and non-hybrid models, which is what `position_embedding_type` becomes here);
- the routed experts' `input_linear` [E, 2I, H] split into `ffn_gate_exps` / `ffn_up_exps`
  (joined back); the shared MLP's `input_linear` [2I, H] into `ffn_gate_shexp` / `ffn_up_shexp`
  (kept apart: the model's own split);
- Granite's multipliers as `attention.scale`, `embedding_scale`, `residual_scale`,
  `logit_scale`. The SSD chunk size is not stored: transformers' default (256).
"""
from __future__ import annotations

from specdeploy.checkpoint import gguf_nemotron_h
from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, joined_gate_up, table_name

ARCHS = ("granitehybrid",)
ROTARY_PERMUTED = True
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ssm_in.weight": "mamba.in_proj.weight", "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_norm.weight": "mamba.norm.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    **{f"attn_{p}.{s}": f"self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    # (the shared MLP under the model's split names: models/granite_hybrid.py)
    "ffn_gate_shexp.weight": "shared_mlp.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_mlp.up_proj.weight",
    "ffn_down_shexp.weight": "shared_mlp.down_proj.weight",
}


def hf_config(reader) -> dict:
    tensors, md = reader.tensor_infos, reader.metadata
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n = int(need("block_count"))
    types = []
    for i in range(n):
        if f"blk.{i}.ssm_in.weight" in tensors:
            types.append("mamba")
        elif f"blk.{i}.attn_q.weight" in tensors:
            types.append("attention")
        else:
            raise CheckpointError(f"{reader.path}: GGUF block {i} holds neither a Mamba2 mixer "
                                  "(ssm_in) nor attention (attn_q)")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    kv = max(kv) if isinstance(kv, list) else int(kv)
    inner, m_heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    gate = next((t for name, t in tensors.items() if name.endswith("ffn_gate_exps.weight")),
                None)
    shared = next((t for name, t in tensors.items() if name.endswith("ffn_gate_shexp.weight")),
                  None)
    if shared is None:
        raise CheckpointError(f"{reader.path}: a granitehybrid GGUF without its shared MLP "
                              "(ffn_gate_shexp)")
    mamba = types.index("mamba") if "mamba" in types else None
    rope = bool(get("rope.scaling.finetuned", False))
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "num_hidden_layers": n, "layer_types": types, "num_attention_heads": heads,
        "num_key_value_heads": kv or heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "position_embedding_type": "rope" if rope else "nope",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in tensors or any(
            f"blk.{i}.attn_q.bias" in tensors for i in range(n)),
        "attention_multiplier": float(get("attention.scale", 1.0)),
        "embedding_multiplier": float(get("embedding_scale", 1.0)),
        "residual_multiplier": float(get("residual_scale", 1.0)),
        "logits_scaling": float(get("logit_scale", 1.0)),
        "num_local_experts": gate.shape[0] if gate else 0,
        "num_experts_per_tok": int(get("expert_used_count", 0) or 0) if gate else 0,
        "intermediate_size": gate.shape[1] if gate else int(get("feed_forward_length", 0)),
        "shared_intermediate_size": shared.shape[0],
        "mamba_n_heads": m_heads, "mamba_d_head": inner // m_heads,
        "mamba_d_state": int(need("ssm.state_size")),
        "mamba_n_groups": int(need("ssm.group_count")),
        "mamba_d_conv": int(need("ssm.conv_kernel")), "mamba_expand": inner // hidden,
        "mamba_conv_bias": mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in tensors,
        "mamba_proj_bias": False, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    return table_name(gguf_name, _GLOBAL, _LAYER)


def joined(reader) -> dict[str, tuple[list[str], int]]:
    return joined_gate_up(reader, "block_sparse_moe.input_linear.weight")


to_hf = gguf_nemotron_h.to_hf
