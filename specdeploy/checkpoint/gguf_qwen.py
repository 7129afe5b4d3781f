"""GGUF architectures "qwen2", "qwen3", "qwen2moe", "qwen3moe", "qwen3vl" and "qwen3vlmoe": Llama-
layout files whose q/k rows are not permuted (Qwen's RoPE is rotate-half, which llama.cpp runs
as NEOX), with q/k/v biases (Qwen2) or per-head q / k RMSNorms (Qwen3, `attn_q_norm` /
`attn_k_norm`); Qwen3-MoE's routed experts stacked with gate and up apart (`ffn_gate_exps`,
`ffn_up_exps`: joined back into the fused gate_up_proj [E, 2I, H]), its router `ffn_gate_inp`.
Metadata as gguf_llama.py reads it under the file's own key prefix. Qwen3-VL's language models
("qwen3vl", "qwen3vlmoe") are Qwen3 / Qwen3-MoE files with interleaved multimodal RoPE
(`rope.dimension_sections`) and `n_deepstack_layers` (models/qwen3_vl.py); their tower is the
mmproj beside them."""
from __future__ import annotations

import re

from specdeploy.checkpoint import gguf_llama
from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_meta import ArchMeta, joined_gate_up

ARCHS = ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "qwen3vl", "qwen3vlmoe")
ROTARY_PERMUTED = False
_OWN = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "ffn_gate_inp": "mlp.gate", "ffn_down_exps": "mlp.experts.down_proj",
        # Qwen2-MoE's gated shared expert
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}}
_HF = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
       "qwen2moe": "Qwen2MoeForCausalLM",
       "qwen3moe": "Qwen3MoeForCausalLM", "qwen3vl": "Qwen3VLForConditionalGeneration",
       "qwen3vlmoe": "Qwen3VLMoeForConditionalGeneration"}
_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
          "qwen3vl": "qwen3_vl",
          "qwen3vlmoe": "qwen3_vl_moe"}
_MOE = ("qwen2moe", "qwen3moe", "qwen3vlmoe")
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_gate_exps\.weight$")


def hf_name(gguf_name: str, cfg: dict | None = None) -> str | None:
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _OWN:
        tail = "" if parts[2] == "ffn_down_exps" else f".{parts[3]}"  # (a 3-D parameter)
        return f"model.layers.{parts[1]}.{_OWN[parts[2]]}{tail}"
    return gguf_llama.hf_name(gguf_name, cfg)


def hf_config(reader) -> dict:
    arch = reader.metadata["general.architecture"]
    cfg = gguf_llama.hf_config(reader, arch, dense_ffn=arch not in _MOE)
    # Qwen2's q/k/v biases are its own (no o_proj bias): model_type says so, not attention_bias
    cfg.update(architectures=[_HF[arch]], model_type=_TYPES[arch], attention_bias=False,
               use_sliding_window=False)
    if arch in _MOE:
        cfg.update(_moe(reader, arch))
    if arch.startswith("qwen3vl"):
        cfg.update(_vl(reader, arch, cfg))
    return cfg


def _vl(reader, arch: str, cfg: dict) -> dict:
    """Multimodal RoPE (llama.cpp runs these as IMROPE: the interleaved sections) and the
    number of DeepStack levels the embeddings input carries."""
    meta = ArchMeta(reader, arch)
    if meta.get("deepstack_mapping") is not None:
        raise CheckpointError(f"{reader.path}: {arch}.deepstack_mapping is not supported (the "
                              "levels go to the first decoder layers)")
    sections = [int(s) for s in meta.need("rope.dimension_sections")]
    return {"rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                "mrope_section": sections[:3], "mrope_interleaved": True},
            "num_deepstack_layers": int(meta.get("n_deepstack_layers", 0) or 0)}


def _moe(reader, arch: str) -> dict:
    tensors = reader.tensor_infos
    meta = ArchMeta(reader, arch)
    gate = tensors.get("blk.0.ffn_gate_exps.weight") or next(
        (t for n, t in tensors.items() if _EXPS.match(n)), None)
    if gate is None:
        raise CheckpointError(f"{reader.path}: a {arch} GGUF without routed experts "
                              "(ffn_gate_exps)")
    n = int(meta.need("block_count"))
    dense = [i for i in range(n) if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
    # llama.cpp renormalizes Qwen3-MoE's top-k weights (its configs say norm_topk_prob), not
    # Qwen2-MoE's (Qwen1.5-MoE's configs: false)
    out = {"num_experts": gate.shape[0], "num_experts_per_tok":
           int(meta.need("expert_used_count")), "moe_intermediate_size": gate.shape[1],
           "norm_topk_prob": arch != "qwen2moe", "decoder_sparse_step": 1,
           "mlp_only_layers": dense}
    if arch == "qwen2moe":
        shared = tensors.get("blk.0.ffn_up_shexp.weight")
        if shared is None:
            raise CheckpointError(f"{reader.path}: a qwen2moe GGUF without its shared expert "
                                  "(ffn_up_shexp)")
        out.update(shared_expert_intermediate_size=shared.shape[0], qkv_bias=True)
    return out


def joined(reader) -> dict[str, tuple[list[str], int]]:
    """Each MoE layer's fused gate_up_proj [E, 2I, H]: gate rows, then up."""
    return joined_gate_up(reader, "mlp.experts.gate_up_proj")


def to_hf(gguf_name: str, a, cfg: dict):
    if gguf_name.endswith("ffn_gate_inp_shexp.weight"):  # [H] as the converter stores it
        return a.reshape(1, -1)
    return a
