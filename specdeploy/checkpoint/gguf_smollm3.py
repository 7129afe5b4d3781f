"""GGUF architecture "smollm3" (llama.cpp's converter `SmolLM3Model`: the llama layout, q/k rows
permuted for interleaved RoPE like llama's); llama.cpp's runtime leaves RoPE off on every 4th
layer (`n_no_rope_layer_step` fixed at 4; the file carries no per-layer flags), as the released
configs' default `no_rope_layer_interval`."""
from __future__ import annotations

from specdeploy.checkpoint import gguf_llama

ARCHS = ("smollm3",)
ROTARY_PERMUTED = True
hf_name, to_hf = gguf_llama.hf_name, gguf_llama.to_hf


def hf_config(reader) -> dict:
    cfg = gguf_llama.hf_config(reader, "smollm3")
    cfg.update(architectures=["SmolLM3ForCausalLM"], model_type="smollm3",
               no_rope_layer_interval=4, use_sliding_window=False)
    return cfg
