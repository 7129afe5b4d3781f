"""A tiny Gemma 3 VLM as llama.cpp's converter writes it (convert_hf_to_gguf.py, conversion/
gemma.py): the language model as a `gemma3` text GGUF (tests/checkpoint/test_gguf_gemma3.py's
writer, with the image tokens in its vocabulary) and the tower + projector as an mmproj GGUF
(`Gemma3VisionModel`: names from gguf-py's mmproj map, `mm.soft_emb_norm` with its 1 added,
`mm.input_projection` forced to F16, the metadata its `set_gguf_parameters` writes)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.tiny import write_checkpoint


def write_text_gguf(vlm: Path, text_config: dict, out: Path) -> Path:
    from tests.checkpoint.test_gguf_gemma3 import write_gemma3_gguf

    reader = open_checkpoint(vlm)
    src = out.parent / "text_src"
    src.mkdir(exist_ok=True)
    tensors = {"model." + k[len("language_model.model."):]: reader.get(k)
               for k in reader.keys() if k.startswith("language_model.model.")}
    write_checkpoint(src, text_config, tensors)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vlm / f, src / f)
    return write_gemma3_gguf(src, out)


def write_mmproj(vlm: Path, out: Path) -> Path:
    reader = open_checkpoint(vlm)
    cfg = json.loads((vlm / "config.json").read_text())
    v, pre = cfg["vision_config"], json.loads((vlm / "preprocessor_config.json").read_text())
    names = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(v["image_size"])
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["num_hidden_layers"])
    w.add_vision_head_count(v["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_clip_projector_type("gemma3")
    w.add_vision_attention_layernorm_eps(v["layer_norm_eps"])
    w.add_vision_use_gelu(True)
    scale = (v["image_size"] // v["patch_size"]) // int(cfg["mm_tokens_per_image"] ** 0.5)
    if scale != 4:
        w.add_vision_projector_scale_factor(scale)
    for key in sorted(reader.keys()):
        if key.startswith("language_model."):
            continue
        a = reader.get(key).float().numpy()
        if key == "multi_modal_projector.mm_input_projection_weight":
            w.add_tensor("mm.input_projection.weight", a.astype(np.float16),
                         raw_dtype=gguf.GGMLQuantizationType.F16)
            continue
        if key.endswith("soft_emb_norm.weight"):
            a = a + np.float32(1.0)
        hf = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
