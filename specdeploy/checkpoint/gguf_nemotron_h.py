"""GGUF architectures "nemotron_h" and "nemotron_h_moe" (llama.cpp: Nemotron-H, Nano v2,
Nemotron 3 Nano / Super): their metadata as a Hugging Face NemotronH config, their tensor names
as transformers' (`model.layers.N.mixer.*`, the model's own parameter names, so the loader finds
each parameter's blocks by its name; `mtp.layers.{0,1}.*`), their values in the HF layout.

What llama.cpp's converter changes, undone here:
- layer kinds are not stored as a pattern (read here from the tensors each block holds); an
  MTP head (`nextn_predict_layers`) is one trailing block that folds its attention and MoE
  groups (`blk.L.nextn.*`, `post_attention_norm` for the MoE group's norm);
- `ssm_a` holds A = -exp(A_log) as [heads, 1] (read back as A_log = log(-A), in float64),
  `ssm_d` D as [heads, 1], `ssm_conv1d` the conv weight without its middle axis, `ssm_norm`
  the grouped norm as [groups, d_inner / groups];
- q/k projection rows are permuted as for llama's interleaved RoPE (the model has no RoPE, so
  llama.cpp's scores do not see it; the reader restores HF's rows all the same).
Routed experts arrive stacked ([E, I, H] / [E, H, I]). Expert groups come from
`expert_group_count` / `expert_group_used_count` (the checkpoint's `n_group` / `topk_group`),
1 / 1 where absent. NOTE: llama.cpp routes NemotronH's experts without groups whatever these
say (Nemotron 3's released configs have one group, where both agree). The converter takes a
config with `num_experts_per_tok` as "nemotron_h_moe" even without MoE layers.
"""
from __future__ import annotations

import math
import re

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta

ARCHS = ("nemotron_h", "nemotron_h_moe")
ROTARY_PERMUTED = True
_GLOBAL = {"token_embd.weight": "model.embeddings.weight",
           "output_norm.weight": "model.norm_f.weight", "output.weight": "lm_head.weight"}
# blk.N.<stem> -> the layer's HF suffix; `.weight` / `.bias` follow the stem unless noted
_MIXER = {
    "ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_out": "out_proj", "ssm_norm": "norm",
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_up": "up_proj", "ffn_down": "down_proj", "ffn_gate_inp": "gate",
    "ffn_up_shexp": "shared_experts.up_proj", "ffn_down_shexp": "shared_experts.down_proj",
    "ffn_latent_down": "fc1_latent_proj", "ffn_latent_up": "fc2_latent_proj",
}
_WHOLE = {  # GGUF name tail -> HF suffix, whole (no .weight / .bias to carry over)
    "ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj",
    "ffn_down_exps.weight": "mixer.experts.down_proj",
    "attn_norm.weight": "norm.weight",
}
# the MTP block's own tensors (its other ones follow the layer names, split over two groups)
_MTP = {"nextn.enorm.weight": "mtp.layers.0.enorm.weight",
        "nextn.hnorm.weight": "mtp.layers.0.hnorm.weight",
        "nextn.eh_proj.weight": "mtp.layers.0.eh_proj.weight",
        "nextn.shared_head_norm.weight": "mtp.layers.1.final_layernorm.weight",
        "post_attention_norm.weight": "mtp.layers.1.norm.weight",
        "attn_norm.weight": "mtp.layers.0.norm.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _arr(md: dict, key: str, n: int) -> list:
    v = md.get(key, 0)
    return list(v) if isinstance(v, list) else [v] * n


def _kind(tensors: dict, i: int, path) -> str:
    """A layer's kind by the tensors it holds. NOTE: not by the metadata's per-layer KV-head and
    feed-forward arrays, as llama.cpp reads them: its converter (0.3.36's) writes a config that
    transformers filled with MoE defaults as "nemotron_h_moe", MLP layers then with a feed-forward
    length of 0, which reads as Mamba2."""
    for probe, kind in (("ssm_in.weight", "M"), ("attn_q.weight", "*"),
                        ("ffn_up_exps.weight", "E"), ("ffn_up.weight", "-")):
        if f"blk.{i}.{probe}" in tensors:
            return kind
    raise CheckpointError(f"{path}: GGUF block {i} holds no Mamba2, attention, MLP or MoE "
                          "tensors")


def hf_config(reader) -> dict:
    md, tensors, path = reader.metadata, reader.tensor_infos, reader.path
    meta = ArchMeta(reader)
    arch, get, need = meta.arch, meta.get, meta.need
    n_all, nextn = meta.blocks()
    n = n_all - nextn
    kv = _arr(md, f"{arch}.attention.head_count_kv", n_all)
    kinds = [_kind(tensors, i, path) for i in range(n)]
    heads = get("attention.head_count", 0)
    heads = max(heads) if isinstance(heads, list) else int(heads)
    hidden = int(need("embedding_length"))
    inner, ssm_heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    if inner % ssm_heads:
        raise CheckpointError(f"{path}: ssm.inner_size {inner} is not a multiple of "
                              f"ssm.time_step_rank {ssm_heads}")
    mamba = next((i for i, k in enumerate(kinds) if k == "M"), 0)
    mlp = next((i for i, k in enumerate(kinds) if k == "-"), None)
    eps = get("attention.layer_norm_rms_epsilon", get("attention.layer_norm_epsilon", 1e-5))
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "hybrid_override_pattern": "".join(kinds), "num_hidden_layers": n,
        "layer_norm_epsilon": float(eps), "tie_word_embeddings": "output.weight" not in tensors,
        "mamba_num_heads": ssm_heads, "mamba_head_dim": inner // ssm_heads,
        "ssm_state_size": int(need("ssm.state_size")), "n_groups": int(need("ssm.group_count")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "use_conv_bias": f"blk.{mamba}.ssm_conv1d.bias" in tensors,
        "use_bias": f"blk.{mamba}.ssm_in.bias" in tensors,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
        "time_step_limit": [0.0, math.inf],
        "num_attention_heads": heads or 1,
        "num_key_value_heads": max(kv[:n] + [0]) or heads or 1,
        "head_dim": int(get("attention.key_length", hidden // max(heads, 1))),
        "attention_bias": any(f"blk.{i}.attn_q.bias" in tensors for i in range(n)),
        "mlp_bias": mlp is not None and f"blk.{mlp}.ffn_up.bias" in tensors,
        "num_nextn_predict_layers": nextn,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if nextn > 1:
        raise CheckpointError(f"{path}: {nextn} MTP layers; llama.cpp's NemotronH format has 1")
    if nextn:
        cfg["mtp_hybrid_override_pattern"] = "*E"
    if "E" in kinds or nextn:
        e = next((i for i, k in enumerate(kinds) if k == "E"), n)
        up = tensors[f"blk.{e}.ffn_up_exps.weight"].shape  # [E, I, latent or H]
        shared = tensors.get(f"blk.{e}.ffn_up_shexp.weight")
        cfg.update({
            "n_routed_experts": up[0], "moe_intermediate_size": up[1],
            "num_experts_per_tok": int(need("expert_used_count")),
            "moe_shared_expert_intermediate_size": shared.shape[0] if shared else 0,
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
            "n_group": int(get("expert_group_count", 1) or 1),
            "topk_group": int(get("expert_group_used_count", 1) or 1),
        })
        if f"blk.{e}.ffn_latent_down.weight" in tensors:
            cfg["moe_latent_size"] = tensors[f"blk.{e}.ffn_latent_down.weight"].shape[0]
    if mlp is not None:
        cfg["intermediate_size"] = tensors[f"blk.{mlp}.ffn_up.weight"].shape[0]
    return cfg


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    i, tail = int(m.group(1)), m.group(2)
    n = cfg["num_hidden_layers"]
    if i >= n:  # the MTP block: attention group 0, MoE group 1
        if tail in _MTP:
            return _MTP[tail]
        hf = _layer_suffix(tail)
        if hf is None:
            return None
        group = 0 if tail.startswith("attn_") else 1
        return f"mtp.layers.{group}.{hf}"
    hf = _layer_suffix(tail)
    return None if hf is None else f"model.layers.{i}.{hf}"


def _layer_suffix(tail: str) -> str | None:
    if tail in _WHOLE:
        return _WHOLE[tail]
    stem, _, kind = tail.rpartition(".")
    if stem in _MIXER and kind in ("weight", "bias"):
        return f"mixer.{_MIXER[stem]}.{kind}"
    return None


def to_hf(gguf_name: str, a: np.ndarray, cfg: dict) -> np.ndarray:
    """A tensor's values in the HF layout."""
    if gguf_name.endswith(".ssm_a"):
        with np.errstate(divide="ignore"):
            return np.log(-a.astype(np.float64)).astype(np.float32).reshape(-1)
    if gguf_name.endswith(".ssm_d"):
        return a.reshape(-1)
    if gguf_name.endswith(".ssm_norm.weight"):
        return a.reshape(-1)
    if gguf_name.endswith(".ssm_conv1d.weight"):
        return a.reshape(a.shape[0], 1, a.shape[-1])
    return a
