"""GGUF architectures "qwen2" and "qwen3" (llama.cpp): Llama-layout files whose q/k rows are not
permuted (Qwen's RoPE is rotate-half, which llama.cpp runs as NEOX), with q/k/v biases (Qwen2)
or per-head q / k RMSNorms (Qwen3, `attn_q_norm` / `attn_k_norm`). Metadata as gguf_llama.py
reads it under the file's own key prefix."""
from __future__ import annotations

from specdeploy.checkpoint import gguf_llama

ARCHS = ("qwen2", "qwen3")
ROTARY_PERMUTED = False
_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_HF = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_name(gguf_name: str, cfg: dict | None = None) -> str | None:
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NORMS:
        return f"model.layers.{parts[1]}.{_NORMS[parts[2]]}.{parts[3]}"
    return gguf_llama.hf_name(gguf_name, cfg)


def hf_config(reader) -> dict:
    arch = reader.metadata["general.architecture"]
    cfg = gguf_llama.hf_config(reader, arch)
    # Qwen2's q/k/v biases are its own (no o_proj bias): model_type says so, not attention_bias
    cfg.update(architectures=[_HF[arch]], model_type=arch, attention_bias=False,
               use_sliding_window=False)
    return cfg


def to_hf(gguf_name: str, a, cfg: dict):
    return a
