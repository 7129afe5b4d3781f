"""GGUF architecture "clip" with projector "qwen3vl_merger": llama.cpp's mmproj file of a Qwen3.5
or Qwen3-VL vision tower, which ships beside the text GGUF (llama.cpp's `--mmproj`); projector
"gemma3" (Gemma 3's SigLIP tower) is gguf_mmproj_gemma3.py's.

llama.cpp's converter (conversion/qwen3vl.py, `Qwen3VLVisionModel` for
Qwen3_5MoeForConditionalGeneration) writes the tower one tensor for one, under clip names:
`v.blk.N.{attn_qkv, attn_out, ffn_up, ffn_down, ln1, ln2}` are `model.visual.blocks.N.{attn.qkv,
attn.proj, mlp.linear_fc1, mlp.linear_fc2, norm1, norm2}`, `mm.0` / `mm.2` the merger's
`linear_fc1` / `linear_fc2`, `v.post_ln` its norm, `v.position_embd` the position table; the one
value change: the Conv3D patch embedding [C_out, C_in, 2, p, p] split on its temporal axis into
two Conv2D kernels, `v.patch_embd.weight` (t = 0) and `v.patch_embd.weight.1` (t = 1), joined
back here. The vision config comes from the `clip.vision.*` metadata, the image preprocessing
(mean, std, patch and merge sizes) too; what the file does not say (the pixel limits of a resize)
takes the released Qwen3.5 preprocessor's values (`PIXEL_LIMITS`; `mm_processor_kwargs`
overrides them, as vLLM's). Qwen3-VL's DeepStack mergers are `v.deepstack.N.{norm, fc1, fc2}`
under the index N of the block they follow (`clip.vision.is_deepstack_layers` marks those
blocks): `model.visual.deepstack_merger_list.L.{norm, linear_fc1, linear_fc2}`, L counting the
marked blocks in order.
"""
from __future__ import annotations

import re

import numpy as np

from specdeploy.checkpoint import gguf_mmproj_gemma3 as gemma3
from specdeploy.checkpoint.errors import CheckpointError

ARCHS = ("clip",)
ROTARY_PERMUTED = False
PROJECTORS = ("qwen3vl_merger", "gemma3")
# the released Qwen3.5 preprocessor_config.json's size: {"shortest_edge", "longest_edge"}
PIXEL_LIMITS = {"min_pixels": 65536, "max_pixels": 16777216}
_BLOCK = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1",
          "ffn_down": "mlp.linear_fc2", "ln1": "norm1", "ln2": "norm2"}
_TOP = {"mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2", "v.post_ln": "merger.norm",
        "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}
_PATCH = ("v.patch_embd.weight", "v.patch_embd.weight.1")
_DEEP = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def hf_config(reader) -> dict:
    """{"vision_config": the tower's HF vision config, "preprocessor": the image processor's
    fields}; a file this tower cannot be is refused by name."""
    md, path = reader.metadata, reader.path
    proj = md.get("clip.projector_type")
    if proj not in PROJECTORS:
        raise CheckpointError(f"{path}: mmproj projector {proj!r} is not supported; supported: "
                              f"{', '.join(PROJECTORS)} (Qwen3.5 / Qwen3-VL and Gemma 3 "
                              "vision towers)")
    if not md.get("clip.has_vision_encoder", False):
        raise CheckpointError(f"{path}: mmproj without a vision encoder")
    if proj == gemma3.PROJECTOR:
        return gemma3.hf_config(reader)

    def get(key: str):
        if f"clip.vision.{key}" not in md:
            raise CheckpointError(f"{path}: mmproj metadata clip.vision.{key} is missing")
        return md[f"clip.vision.{key}"]

    infos = reader.tensor_infos
    missing = [n for n in (*_PATCH, "v.position_embd.weight") if n not in infos]
    if missing:
        raise CheckpointError(f"{path}: mmproj tensors missing: {', '.join(missing)} (a "
                              "Qwen3.5 tower's patch embedding is two temporal halves)")
    if not md.get("clip.use_gelu", False):
        raise CheckpointError(f"{path}: mmproj activation is not GELU (clip.use_gelu)")
    patch = int(get("patch_size"))
    vision = {
        "model_type": "qwen3_5_moe_vision", "depth": int(get("block_count")),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_heads": int(get("attention.head_count")), "in_channels": infos[_PATCH[0]].shape[1],
        "patch_size": patch, "temporal_patch_size": len(_PATCH),
        "spatial_merge_size": int(get("spatial_merge_size")),
        "out_hidden_size": int(get("projection_dim")),
        "num_position_embeddings": infos["v.position_embd.weight"].shape[0],
        "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [i for i, on in enumerate(
            md.get("clip.vision.is_deepstack_layers") or ()) if on],
    }
    pre = {"patch_size": patch, "temporal_patch_size": len(_PATCH),
           "merge_size": vision["spatial_merge_size"],
           "image_mean": [float(x) for x in get("image_mean")],
           "image_std": [float(x) for x in get("image_std")], **PIXEL_LIMITS}
    for ours, theirs in (("min_pixels", "image_min_pixels"), ("max_pixels", "image_max_pixels")):
        if f"clip.vision.{theirs}" in md:
            pre[ours] = int(md[f"clip.vision.{theirs}"])
    return {"vision_config": vision, "preprocessor": pre}


def hf_name(gguf_name: str, cfg: dict) -> str | None:
    if cfg.get("projector") == gemma3.PROJECTOR:
        return gemma3.hf_name(gguf_name, cfg)
    if gguf_name in _PATCH:
        return None  # joined (`joined`)
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.visual.blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"v\.deepstack\.(\d+)\.(norm|fc1|fc2)\.(weight|bias)", gguf_name)
    if m:
        marked = cfg["vision_config"]["deepstack_visual_indexes"]
        if int(m.group(1)) not in marked:
            raise CheckpointError(f"{gguf_name}: block {m.group(1)} is not marked in "
                                  f"clip.vision.is_deepstack_layers")
        level = marked.index(int(m.group(1)))
        return (f"model.visual.deepstack_merger_list.{level}.{_DEEP[m.group(2)]}."
                f"{m.group(3)}")
    base, _, suffix = gguf_name.rpartition(".")
    return f"model.visual.{_TOP[base]}.{suffix}" if base in _TOP else None


def joined(reader) -> dict[str, tuple[list[str], int]]:
    if reader.config.get("projector") == gemma3.PROJECTOR:
        return {}
    return {"model.visual.patch_embed.proj.weight": (list(_PATCH), 2)}


def to_hf(gguf_name: str, a: np.ndarray, cfg: dict) -> np.ndarray:
    if cfg.get("projector") == gemma3.PROJECTOR:
        return gemma3.to_hf(gguf_name, a, cfg)
    return a[:, :, None] if gguf_name in _PATCH else a  # a temporal half [C_out, C_in, 1, p, p]
