"""Architecture name → model family module (see docs/interfaces.md, "Model modules")."""
from __future__ import annotations

import importlib
from types import ModuleType

# HF `architectures[0]` → module path. Each module exposes ARCHITECTURES, Config, Model,
# checkpoint_to_params, params_to_checkpoint, tiny_hf_config.
_FAMILIES = {
    "llama": "specdeploy.models.llama",
    "nemotron_h": "specdeploy.models.nemotron_h",
    "qwen3_5_moe": "specdeploy.models.qwen3_5_moe",
    "qwen3_moe": "specdeploy.models.qwen3_moe",
    "qwen3_vl": "specdeploy.models.qwen3_vl",
    "qwen3_next": "specdeploy.models.qwen3_next",
    "glm4_moe": "specdeploy.models.glm4_moe",
    "deepseek_v3": "specdeploy.models.deepseek_v3",
    "granite_hybrid": "specdeploy.models.granite_hybrid",
    "phi3": "specdeploy.models.phi3",
    "gpt_oss": "specdeploy.models.gpt_oss",
    "lfm2": "specdeploy.models.lfm2",
    "gemma3": "specdeploy.models.gemma3",
}
_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # (its sliding window per layer, as Qwen2 / Qwen3's)
    "Qwen2ForCausalLM": "llama",  # Llama + q/k/v biases
    "Qwen3ForCausalLM": "llama",  # Llama + per-head q/k RMSNorms
    "SmolLM3ForCausalLM": "llama",  # Llama without RoPE on every 4th layer (NoPE)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen3_moe",  # Qwen2's attention, a gated shared expert
    "NemotronHForCausalLM": "nemotron_h",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    # dense Qwen3.5: the same module (models/qwen3_5_blocks.py: an MLP in place of the MoE)
    "Qwen3_5ForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_moe",
    # Qwen3-VL / Qwen3-VL-MoE: Qwen3 (-MoE) layers, multimodal RoPE, DeepStack
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    # Qwen3-Next: Qwen3.5-MoE's blocks, 1-D RoPE, GDN projections grouped per key head
    "Qwen3NextForCausalLM": "qwen3_next",
    # GLM-4.5 / 4.6 / 4.7: Llama-style attention (partial RoPE), sigmoid-routed MoE, MTP
    "Glm4MoeForCausalLM": "glm4_moe",
    # DeepSeek-V3 / R1 / Kimi K2 / V2: multi-head latent attention, GLM-4.5's MoE and MTP layout
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v3",  # (softmax routing, greedy or group-limited)
    # IBM Granite 4.0 (-H): Mamba2 (NemotronH's mixer) + attention (NoPE or RoPE) + MoE
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    # Phi-3 / 3.5 / 4: Llama with fused qkv / gate_up tensors, partial RoPE, LongRoPE
    "Phi3ForCausalLM": "phi3",
    # OpenAI gpt-oss: attention sinks, alternating sliding windows, YaRN, biased MoE (MXFP4)
    "GptOssForCausalLM": "gpt_oss",
    # Liquid AI LFM2: gated short convolutions (cached causal conv) + GQA with q/k norms
    "Lfm2ForCausalLM": "lfm2",
    # Google Gemma 3: 1 + w norms, four a layer, GeGLU, scaled embeddings, local / global RoPE;
    # the multimodal releases' language model, text only (their vision tower is not read)
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}


class UnsupportedArchitecture(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_ARCH_TO_FAMILY)


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def family_module(name: str) -> ModuleType:
    """Module for a family name (`llama`) or an HF architecture (`LlamaForCausalLM`)."""
    fam = _ARCH_TO_FAMILY.get(name, name)
    if fam not in _FAMILIES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    return importlib.import_module(_FAMILIES[fam])


def module_for_config(hf_config: dict) -> ModuleType:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise UnsupportedArchitecture(
            "config.json has no 'architectures'; supported: " + ", ".join(supported_architectures())
        )
    return family_module(archs[0])
