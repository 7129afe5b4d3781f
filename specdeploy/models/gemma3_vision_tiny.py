"""`make-tiny --arch gemma3_vl`: a tiny random `Gemma3ForConditionalGeneration` in the released
layout (`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`,
Gemma norms stored as w), a 56 x 56 SigLIP tower of 14-pixel patches pooled to 4 image tokens,
`preprocessor_config.json`, and a tokenizer with `<start_of_image>`, `<end_of_image>` and
`<image_soft_token>` at the config's ids and a chat template that renders an image part as
`<start_of_image>` (as the released template does)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdeploy.models import gemma3
from specdeploy.models.gemma3_vision import VisionConfig, VisionModel

BOI, EOI, IMAGE = 124, 125, 126
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "processor_class":
                "Gemma3Processor", "do_resize": True, "size": {"height": 56, "width": 56},
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "do_convert_rgb": True, "do_pan_and_scan": False}


def tiny_hf_config() -> dict:
    text = {k: v for k, v in gemma3.tiny_hf_config().items()
            if k not in ("architectures", "torch_dtype")}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 56,
              "patch_size": 14, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
              "vision_use_head": False}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4,
            "boi_token_index": BOI, "eoi_token_index": EOI, "image_token_index": IMAGE,
            "tie_word_embeddings": True, "torch_dtype": "float32"}


def make_tiny(out: str | Path, seed: int = 0, mtp_layers: int = 0) -> Path:
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer

    if mtp_layers:
        raise ValueError("Gemma 3 has no MTP layers")
    import tempfile

    from specdeploy.checkpoint import open_checkpoint

    hf = tiny_hf_config()
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        reader = open_checkpoint(gemma3.make_tiny(tmp, seed=seed, hf_config={
            **gemma3.tiny_hf_config(), **hf["text_config"]}))
        tensors = {"language_model." + k: reader.get(k).clone() for k in reader.keys()}
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in VisionModel(VisionConfig.from_hf(hf)).state_dict().items()}
    for name, shape in shapes.items():
        r = torch.randn(shape, generator=gen)
        if "layer_norm" in name or "post_layernorm" in name:
            t = 1.0 + 0.1 * r if name.endswith("weight") else 0.02 * r
        elif "norm" in name:  # the projector's Gemma RMSNorm: stored w, applied as 1 + w
            t = 0.1 * r
        elif name.endswith("bias"):
            t = 0.02 * r
        elif "position_embedding" in name:
            t = r
        elif name.endswith("mm_input_projection_weight"):
            t = r * shape[0] ** -0.5
        else:
            t = r * torch.Size(shape[1:]).numel() ** -0.5
        tensors[name] = t
    write_checkpoint(out, hf, tensors)
    write_tiny_tokenizer(out, hf["text_config"]["vocab_size"],
                         {BOI: "<start_of_image>", EOI: "<end_of_image>",
                          IMAGE: "<image_soft_token>"}, CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return out


__all__ = ["make_tiny", "tiny_hf_config"]
