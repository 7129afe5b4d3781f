"""A tiny Qwen3.5 / Qwen3-VL VLM's vision tower written as llama.cpp's converter writes its
mmproj GGUF (convert_hf_to_gguf.py --mmproj: conversion/qwen3vl.py `Qwen3VLVisionModel`), for
the tests.

Names come from gguf-py's own map for the mmproj arch (`gguf.get_tensor_name_map`, not the
reader's); the converter's own handling: the merger's fc1 / fc2 as `mm.0` / `mm.2`, its norm as
`v.post_ln`, Qwen3-VL's DeepStack mergers as `v.deepstack.{block}.{norm,fc1,fc2}`, the Conv3D
patch embedding split on its temporal axis into two Conv2D kernels (`v.patch_embd.weight`,
`v.patch_embd.weight.1`); the metadata its `set_gguf_parameters` writes (the attention norm's
eps is the text model's rms_norm_eps, as there).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from specdeploy.checkpoint import open_checkpoint


def write_mmproj(src: Path, out: Path, ftype=gguf.GGMLQuantizationType.F32,
                 projector: str = "qwen3vl_merger", pixels: tuple[int, int] | None = None,
                 skip: tuple[str, ...] = ()) -> Path:
    """`src` (qwen3_5_moe.make_tiny) tower as an mmproj GGUF (`ftype` F16 / BF16 / Q8_0: the
    matrices, as the converter's --outtype; Q8_0 where a row is whole blocks); `pixels` (min,
    max) writes the resize limits newer converters write; `skip`: GGUF tensor names left out."""
    reader = open_checkpoint(src)
    cfg = reader.config
    v = cfg["vision_config"]
    names = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, v["depth"])
    tensors = {}
    for key in reader.keys():
        if not key.startswith("model.visual."):
            continue
        a = reader.get(key).float().numpy()
        name = key.replace("model.visual.", "visual.", 1)
        if name == "visual.patch_embed.proj.weight":
            tensors["v.patch_embd.weight"] = a[:, :, 0]
            tensors["v.patch_embd.weight.1"] = a[:, :, 1]
            continue
        if name == "visual.patch_embed.proj.bias":
            tensors["v.patch_embd.bias"] = a
            continue
        if name.startswith("visual.deepstack_merger_list."):  # under the block's own index
            level, part, suffix = name.split(".")[2:]
            block = v["deepstack_visual_indexes"][int(level)]
            short = {"linear_fc1": "fc1", "linear_fc2": "fc2", "norm": "norm"}[part]
            tensors[f"v.deepstack.{block}.{short}.{suffix}"] = a
            continue
        if name.startswith("visual.merger."):
            part, suffix = name.split(".")[2:]
            base = {"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}[part]
            tensors[f"{base}.{suffix}"] = a
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        tensors[mapped] = a
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(v["out_hidden_size"])
    w.add_vision_image_size(int(v["num_position_embeddings"] ** 0.5 * v["patch_size"]))
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["depth"])
    w.add_vision_head_count(v["num_heads"])
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_clip_projector_type(projector)
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(v["spatial_merge_size"])
    w.add_vision_attention_layernorm_eps(cfg["text_config"]["rms_norm_eps"])
    deep = v.get("deepstack_visual_indexes") or ()
    w.add_vision_is_deepstack_layers([i in deep for i in range(v["depth"])])
    if pixels is not None:
        w.add_vision_min_pixels(pixels[0])
        w.add_vision_max_pixels(pixels[1])
    for name, a in sorted(tensors.items()):
        if name in skip:
            continue
        if ftype == gguf.GGMLQuantizationType.F16 and a.ndim > 1:
            w.add_tensor(name, a.astype(np.float16), raw_dtype=ftype)
        elif ftype == gguf.GGMLQuantizationType.Q8_0 and a.ndim == 2 and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, ftype), raw_dtype=ftype)
        elif ftype == gguf.GGMLQuantizationType.BF16 and a.ndim > 1:
            w.add_tensor(name, gguf.quants.quantize(a, ftype), raw_dtype=ftype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
