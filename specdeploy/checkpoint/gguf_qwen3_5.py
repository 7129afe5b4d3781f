"""GGUF architectures "qwen35moe", "qwen35" and "qwen3next" (llama.cpp: Qwen3.5-MoE, dense
Qwen3.5, text; Qwen3-Next):
its metadata as a Hugging Face Qwen3.5(-MoE) text config, its tensors under the text
checkpoint's names (`model.layers.N.*`, `mtp.*`), its values in the HF layout. (A GGUF holds no
vision tower: llama.cpp keeps it in a separate mmproj file.)

What llama.cpp's converter changes, undone here:
- every RMSNorm weight but the gated delta net's output norm is stored as 1 + w (the HF
  checkpoint's zero-centred w, to which the model adds 1 again at load; exact in fp32, since
  1 + w - 1 is);
- A_log is stored as A = -exp(A_log), the conv1d weight without its middle axis;
- where the net has fewer key heads than value heads, the value heads are reordered from
  grouped by key head ([k0: v0 v1 ..][k1: ..]) to tiled ([v0: k0 k1 ..][v1: ..]): the V rows
  of `attn_qkv`, the rows of `attn_gate` (z), `ssm_alpha` / `ssm_beta`, `ssm_a`, `ssm_dt`, the
  V channels of `ssm_conv1d` and the columns of `ssm_out`;
- routed experts are stacked with gate and up apart (`ffn_gate_exps`, `ffn_up_exps`; joined
  back into the checkpoint's fused gate_up_proj [E, 2I, H]); the MTP head is the trailing
  block(s) (`nextn_predict_layers`), its fc / norms as `nextn.*`;
- a dense model's MLP is `ffn_gate` / `ffn_up` / `ffn_down` (as llama's).
Qwen3-Next's files ("qwen3next") are Qwen3.5-MoE's but for three things: 1-D RoPE (no dimension
sections), value heads left grouped by key head (its converter does not tile them), and b / a
kept in one grouped tensor (`ssm_ba`, the checkpoint's `in_proj_ba`, which models/qwen3_next.py
splits). Layer kinds come from the tensors a block holds (`attn_qkv`: gated delta net, `attn_q`:
full attention). llama.cpp always renormalizes the top-k router weights (norm_topk_prob is not
stored): so does this config. q/k rows are not permuted (Qwen's RoPE is rotate-half).
"""
from __future__ import annotations

import re

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta

ARCHS = ("qwen35moe", "qwen35", "qwen3next")
ROTARY_PERMUTED = False
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {  # blk.N.<tail> -> the layer's HF suffix
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",  # (qwen3next: grouped per key head)
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",  # a dense model's MLP
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_MTP_OWN = {"nextn.eh_proj.weight": "mtp.fc.weight",
            "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
            "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "nextn.shared_head_norm.weight": "mtp.norm.weight"}
# stored as 1 + w (the converter's +1 on every `norm.weight` but linear_attn.norm)
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
             "attn_k_norm.weight", "output_norm.weight", "nextn.enorm.weight",
             "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_config(reader) -> dict:
    md, tensors, path = reader.metadata, reader.tensor_infos, reader.path
    meta = ArchMeta(reader)
    get, need = meta.get, meta.need
    n_all, nextn = meta.blocks()
    n = n_all - nextn
    types = []
    for i in range(n):
        if f"blk.{i}.attn_qkv.weight" in tensors:
            types.append("linear_attention")
        elif f"blk.{i}.attn_q.weight" in tensors:
            types.append("full_attention")
        else:
            raise CheckpointError(f"{path}: GGUF block {i} holds neither a gated delta net "
                                  "(attn_qkv) nor attention (attn_q)")
    full = types.index("full_attention") if "full_attention" in types else None
    heads, kv = get("attention.head_count", 0), get("attention.head_count_kv", 0)
    heads = max(heads) if isinstance(heads, list) else int(heads)
    kv = max(kv) if isinstance(kv, list) else int(kv or heads)
    head_dim = int(get("attention.key_length", 0) or int(need("embedding_length")) // heads)
    inner, nv = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    if inner % nv:
        raise CheckpointError(f"{path}: ssm.inner_size {inner} is not a multiple of "
                              f"ssm.time_step_rank {nv}")
    dense = md.get("general.architecture") == "qwen35"
    nxt = md.get("general.architecture") == "qwen3next"
    sections = list(get("rope.dimension_sections", []) or [11, 11, 10])
    rope_dim = int(get("rope.dimension_count", head_dim // 4))
    text = {
        "model_type": "qwen3_5_text" if dense else "qwen3_5_moe_text",
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": int(need("embedding_length")), "num_hidden_layers": n,
        "layer_types": types, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "linear_num_key_heads": int(need("ssm.group_count")),
        "linear_num_value_heads": nv, "linear_key_head_dim": int(need("ssm.state_size")),
        "linear_value_head_dim": inner // nv,
        "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
        **(_dense_ffn(reader) if dense else _moe_ffn(reader, need)),
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": full is not None and f"blk.{full}.attn_q.bias" in tensors,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 1e7)),
                            "partial_rotary_factor": rope_dim / head_dim,
                            **({} if nxt else {"mrope_section": [s for s in sections[:3]],
                                               "mrope_interleaved": True})},
        "mtp_num_hidden_layers": nextn,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    arch, kind = (("Qwen3_5ForCausalLM", "qwen3_5") if dense
                  else ("Qwen3NextForCausalLM", "qwen3_next") if nxt
                  else ("Qwen3_5MoeForCausalLM", "qwen3_5_moe"))
    if nxt:
        text["model_type"] = "qwen3_next"
    return {"architectures": [arch], "model_type": kind,
            "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}


def _moe_ffn(reader, need) -> dict:
    tensors = reader.tensor_infos
    if "blk.0.ffn_gate_exps.weight" not in tensors:
        raise CheckpointError(f"{reader.path}: a qwen35moe GGUF without routed experts "
                              "(blk.0.ffn_gate_exps)")
    gate = tensors["blk.0.ffn_gate_exps.weight"].shape  # [E, I, H]
    shared = tensors.get("blk.0.ffn_up_shexp.weight")
    # llama.cpp always renormalizes the top-k router weights (norm_topk_prob is not stored)
    return {"num_experts": gate[0], "num_experts_per_tok": int(need("expert_used_count")),
            "moe_intermediate_size": gate[1],
            "shared_expert_intermediate_size": shared.shape[0] if shared else 0,
            "norm_topk_prob": True}


def _dense_ffn(reader) -> dict:
    gate = reader.tensor_infos.get("blk.0.ffn_gate.weight")
    if gate is None:
        raise CheckpointError(f"{reader.path}: a qwen35 GGUF without its MLP (blk.0.ffn_gate)")
    return {"intermediate_size": gate.shape[0]}  # [I, H]


def _prefix(i: int, cfg: dict) -> str:
    n = cfg["text_config"]["num_hidden_layers"]
    return f"model.layers.{i}." if i < n else f"mtp.layers.{i - n}."


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    i, tail = int(m.group(1)), m.group(2)
    if i >= cfg["text_config"]["num_hidden_layers"] and tail in _MTP_OWN:
        return _MTP_OWN[tail]  # (one MTP layer: the converter folds these into its block)
    return _prefix(i, cfg) + _LAYER[tail] if tail in _LAYER else None


def joined(reader) -> dict[str, tuple[list[str], int]]:
    """The checkpoint's fused gate_up_proj [E, 2I, H] of each block: gate rows, then up."""
    out = {}
    for name in reader.tensor_infos:
        m = _BLK.match(name)
        if m and m.group(2) == "ffn_gate_exps.weight":
            up = f"blk.{m.group(1)}.ffn_up_exps.weight"
            if up in reader.tensor_infos:
                hf = _prefix(int(m.group(1)), reader.config) + "mlp.experts.gate_up_proj"
                out[hf] = ([name, up], 1)
    return out


def to_hf(gguf_name: str, a: np.ndarray, cfg: dict) -> np.ndarray:
    """A tensor's values in the HF layout."""
    t = cfg["text_config"]
    tail = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    if tail in _PLUS_ONE:
        return a - np.float32(1.0)
    if tail == "ssm_a":
        with np.errstate(divide="ignore"):
            a = np.log(-a.astype(np.float64)).astype(np.float32).reshape(-1)
    elif tail == "ssm_conv1d.weight":
        a = a.reshape(a.shape[0], 1, a.shape[-1])
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    if nk == nv or nk <= 0 or not tail.startswith(("attn_qkv", "attn_gate", "ssm_")) or \
            cfg["model_type"] == "qwen3_next":  # (its value heads stay grouped)
        return a
    dv, qk = t["linear_value_head_dim"], 2 * nk * t["linear_key_head_dim"]
    if tail in ("attn_qkv.weight", "ssm_conv1d.weight"):
        return np.concatenate([a[:qk], _grouped(a[qk:], 0, nk, nv // nk, dv)])
    if tail == "attn_gate.weight":
        return _grouped(a, 0, nk, nv // nk, dv)
    if tail in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
        return _grouped(a, 0, nk, nv // nk, 1)
    if tail == "ssm_out.weight":
        return _grouped(a, 1, nk, nv // nk, dv)
    return a


def blocks_hf(gguf_name: str, raw: np.ndarray, cfg: dict):
    """A quantized matrix's block rows in the HF order, or None where whole rows cannot give
    it (value changes: norms, A). Row reorders are `to_hf`'s, on rows of blocks. `ssm_out`'s
    value-head column reorder would split blocks (a K-quant block spans two 128-wide heads):
    its blocks stay as stored, returned as (blocks, cols) with HF column j = stored column
    cols[j], and the kernels read x's columns in the stored order (ops/ggml_linear.py
    `GGMLWeight.gather`)."""
    tail = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    t = cfg["text_config"]
    if tail in _PLUS_ONE or tail == "ssm_a":
        return None
    if tail == "ssm_out.weight" and t["linear_num_key_heads"] != t["linear_num_value_heads"] \
            and cfg["model_type"] != "qwen3_next":
        nk, nv, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"],
                      t["linear_value_head_dim"])
        cols = _grouped(np.arange(nv * dv)[None], 1, nk, nv // nk, dv)[0]
        return raw, np.ascontiguousarray(cols, dtype=np.int64)
    return to_hf(gguf_name, raw, cfg)


def _grouped(a: np.ndarray, dim: int, nk: int, per_k: int, d: int) -> np.ndarray:
    """Value heads on `dim` from the converter's tiled order [per_k, nk, d] back to grouped by
    key head [nk, per_k, d]."""
    shape = a.shape
    a = a.reshape(*shape[:dim], per_k, nk, d, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(a, dim, dim + 1)).reshape(shape)
