"""A tiny Qwen3.5(-MoE) or Qwen3-Next safetensors checkpoint written as llama.cpp's converter
writes its GGUF (convert_hf_to_gguf.py: Qwen3_5MoeTextModel, _LinearAttentionVReorderBase,
Qwen3NextModel, _QwenMtpMixin, Qwen2MoeModel), for the tests. Qwen3-Next: `in_proj_qkvz` split
into q | k | v and z (value heads kept grouped), `in_proj_ba` as it is, no RoPE sections.

Names come from gguf-py's own map (`gguf.get_tensor_name_map`, not the reader's); the MTP
block's own names, which gguf-py 0.19 does not map yet, and the value changes follow the
converter: +1 on every norm but the gated delta net's, A_log -> -exp(A_log), conv1d without its
middle axis, value heads from grouped by key head to tiled where there are fewer key heads,
routed experts stacked with gate and up apart, the MTP layer as trailing block(s).
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from specdeploy.checkpoint import open_checkpoint
from tests.checkpoint.gguf_nemotron_h_layout import Q, add_tokenizer, quantized_or_f32

MTP_OWN = {"mtp.fc.weight": "nextn.eh_proj.weight",
           "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
           "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
           "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def tiled(a: np.ndarray, dim: int, nk: int, per_k: int, d: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: [nk, per_k, d] on `dim` to [per_k, nk, d]."""
    shape = a.shape
    a = a.reshape(*shape[:dim], nk, per_k, d, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(a, dim, dim + 1)).reshape(shape)


def _converted(src: Path):
    reader = open_checkpoint(src)
    text = reader.config.get("text_config", reader.config)
    n, nextn = text["num_hidden_layers"], text.get("mtp_num_hidden_layers", 0)
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    nxt = text.get("model_type", reader.config.get("model_type")) == "qwen3_next"
    arch = (MODEL_ARCH.QWEN3NEXT if nxt else MODEL_ARCH.QWEN35MOE if text.get("num_experts")
            else MODEL_ARCH.QWEN35)
    names = gguf.get_tensor_name_map(arch, n + nextn)
    out, experts = {}, defaultdict(dict)
    for key in reader.keys():
        if key.startswith("model.visual."):
            continue  # (llama.cpp writes the vision tower to a separate mmproj file)
        w = reader.get(key).numpy().astype(np.float32)
        hf = key.replace("model.language_model.", "model.")
        if hf in MTP_OWN:  # norms (stored + 1) but fc
            out[f"blk.{n}.{MTP_OWN[hf]}"] = w if hf == "mtp.fc.weight" else w + 1
            continue
        m = re.match(r"mtp\.layers\.(\d+)\.(.+)", hf)
        if m:
            hf = f"model.layers.{n + int(m.group(1))}.{m.group(2)}"
        bid = int(hf.split(".")[2]) if hf.startswith("model.layers.") else None
        if ".mlp.experts." in hf:
            experts[(bid, hf.rsplit(".", 2)[1])][int(hf.split(".")[5])] = w
            continue
        if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            w = w + 1
        if hf.endswith(".A_log"):
            w = -np.exp(w)
        elif hf.endswith(".dt_bias"):
            hf = hf[: -len(".dt_bias")] + ".dt_proj.bias"
        elif "conv1d" in hf:
            w = w.squeeze()
        if nxt and hf.endswith(".in_proj_qkvz.weight"):  # Qwen3NextModel: q | k | v, and z
            g = w.reshape(nk, 2 * dk + 2 * (nv // nk) * dv, -1)
            q, k, v, z = np.split(g, np.cumsum([dk, dk, (nv // nk) * dv])[:3], axis=1)
            qkv = np.concatenate([t.reshape(-1, g.shape[-1]) for t in (q, k, v)])
            base = hf[: -len("in_proj_qkvz.weight")]
            out[names.get_name(base + "in_proj_qkv.weight", try_suffixes=(".weight",))] = qkv
            out[names.get_name(base + "in_proj_z.weight", try_suffixes=(".weight",))] = \
                z.reshape(-1, g.shape[-1])
            continue
        if nk != nv and ".linear_attn." in hf and not nxt:  # (Qwen3-Next: not tiled)
            per_k, qk = nv // nk, 2 * nk * dk
            if ".in_proj_qkv." in hf or ".conv1d." in hf:
                w = np.concatenate([w[:qk], tiled(w[qk:], 0, nk, per_k, dv)])
            elif ".in_proj_z." in hf:
                w = tiled(w, 0, nk, per_k, dv)
            elif ".in_proj_a." in hf or ".in_proj_b." in hf or ".A_log" in hf or ".dt_" in hf:
                w = tiled(w, 0, nk, per_k, 1)
            elif ".out_proj." in hf:
                w = tiled(w, 1, nk, per_k, dv)
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        out[name] = w
    for (bid, proj), by_e in experts.items():
        stacked = np.stack([by_e[e] for e in range(len(by_e))])
        out[names.get_name(f"model.layers.{bid}.mlp.experts.{proj}.weight",
                           try_suffixes=(".weight",))] = stacked
    return out, text, arch


def write_gguf(src: Path, out: Path, qtype=Q.F32, expert_qtype=Q.F32,
               requantized: bool = False) -> Path:
    """`src` (qwen3_5_moe.make_tiny) as a text GGUF, as nemotron_h_layout.write_gguf.
    `requantized`: each tensor's leading size-1 dims dropped, as a file that llama-quantize
    wrote has them (ggml_n_dims: trailing size-1 ne dims are not written)."""
    tensors, t, arch = _converted(src)
    while requantized and any(a.ndim > 1 and a.shape[0] == 1 for a in tensors.values()):
        tensors = {k: a[0] if a.ndim > 1 and a.shape[0] == 1 else a for k, a in tensors.items()}
    n, nextn = t["num_hidden_layers"], t.get("mtp_num_hidden_layers", 0)
    rope = t["rope_parameters"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n + nextn)
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    w.add_head_count(t["num_attention_heads"])
    w.add_head_count_kv(t["num_key_value_heads"])
    if "mrope_section" in rope:  # (Qwen3-Next: 1-D RoPE)
        w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    if arch in (MODEL_ARCH.QWEN35MOE, MODEL_ARCH.QWEN3NEXT):
        w.add_expert_count(t["num_experts"])
        w.add_expert_used_count(t["num_experts_per_tok"])
        w.add_expert_feed_forward_length(t["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(t["shared_expert_intermediate_size"])
    else:  # dense Qwen3.5 (the converter's Qwen3_5TextModel)
        w.add_feed_forward_length(t["intermediate_size"])
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_ssm_conv_kernel(t["linear_conv_kernel_dim"])
    w.add_ssm_state_size(t["linear_key_head_dim"])
    w.add_ssm_group_count(t["linear_num_key_heads"])
    w.add_ssm_time_step_rank(t["linear_num_value_heads"])
    w.add_ssm_inner_size(t["linear_value_head_dim"] * t["linear_num_value_heads"])
    w.add_rope_dimension_count(int(t["head_dim"] * rope["partial_rotary_factor"]))
    add_tokenizer(w, src, t["vocab_size"])
    for name, a in sorted(tensors.items()):
        quantized_or_f32(w, name, a, qtype, expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
