"""GGUF "clip" with projector "gemma3": llama.cpp's mmproj file of Gemma 3's SigLIP tower and
projector (its converter's conversion/gemma.py `Gemma3VisionModel`), beside a `gemma3` text GGUF.

Names are gguf-py's map for the mmproj arch: `v.patch_embd`, `v.position_embd`,
`v.blk.N.{attn_q, attn_k, attn_v, attn_out, ln1, ln2, ffn_up, ffn_down}` (SigLIP's `q/k/v_proj`,
`out_proj`, `layer_norm1/2`, `mlp.fc1/fc2`), `v.post_ln`, `mm.input_projection` (the
projector's [D_v, H] matrix as transformers holds it; F16) and `mm.soft_emb_norm` (stored with
the Gemma norm's 1 added, taken off here: fp32's (1 + w) - 1 is exact, so 1 + it is the stored
value). Config from `clip.vision.*`; `mm_tokens_per_image` from the patch grid and
`clip.vision.projector.scale_factor` (written only when not 4: the releases' 64 / 4 = 16 a
side); the image's size, mean and std from the metadata too.
"""
from __future__ import annotations

import re

import numpy as np

from specdeploy.checkpoint.errors import CheckpointError

PROJECTOR = "gemma3"
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
          "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER = "vision_tower.vision_model."
_TOP = {"v.patch_embd": _TOWER + "embeddings.patch_embedding",
        "v.position_embd": _TOWER + "embeddings.position_embedding",
        "v.post_ln": _TOWER + "post_layernorm",
        "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
_PROJ = "mm.input_projection.weight"


def hf_config(reader) -> dict:
    """As a `Gemma3ForConditionalGeneration` config.json's vision parts, plus "projector" and
    "preprocessor" (the image processor's fields)."""
    md, path = reader.metadata, reader.path

    def get(key: str):
        if f"clip.vision.{key}" not in md:
            raise CheckpointError(f"{path}: mmproj metadata clip.vision.{key} is missing")
        return md[f"clip.vision.{key}"]

    if not md.get("clip.use_gelu", False):
        raise CheckpointError(f"{path}: mmproj activation is not GELU (clip.use_gelu)")
    if _PROJ not in reader.tensor_infos:
        raise CheckpointError(f"{path}: mmproj tensor {_PROJ} is missing")
    size, patch = int(get("image_size")), int(get("patch_size"))
    scale = int(md.get("clip.vision.projector.scale_factor", 4))
    side = (size // patch) // max(scale, 1)
    vision = {"model_type": "siglip_vision_model", "hidden_size": int(get("embedding_length")),
              "intermediate_size": int(get("feed_forward_length")),
              "num_hidden_layers": int(get("block_count")),
              "num_attention_heads": int(get("attention.head_count")),
              "image_size": size, "patch_size": patch,
              "layer_norm_eps": float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
              "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
    pre = {"size": {"height": size, "width": size},
           "image_mean": [float(x) for x in get("image_mean")],
           "image_std": [float(x) for x in get("image_std")]}
    return {"projector": PROJECTOR, "vision_config": vision, "mm_tokens_per_image": side * side,
            "text_config": {"hidden_size": int(get("projection_dim"))}, "preprocessor": pre}


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    if gguf_name == _PROJ:
        return "multi_modal_projector.mm_input_projection_weight"
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"{_TOWER}encoder.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_TOP[base]}.{suffix}" if base in _TOP else None


def to_hf(gguf_name: str, a: np.ndarray, cfg: dict) -> np.ndarray:
    if gguf_name == "mm.soft_emb_norm.weight":
        return (a.astype(np.float32) - np.float32(1.0)).astype(np.float32)
    return a
