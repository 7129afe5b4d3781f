"""The vision half of `make-tiny --arch qwen3_5_moe`: random `model.visual.*` weights in the
released layout, `preprocessor_config.json`, the image special tokens and a chat template that
renders image parts as the released Qwen3.5 template does, so that transformers' `AutoProcessor`
and `AutoModelForImageTextToText` load and run the directory (the tests' oracle)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.models.qwen3_5_vision import VisionConfig, VisionModel

# The released template's content loop, reduced to text and image parts.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# patch 4 x merge 2: 8-pixel steps; up to 224 x 224 (784 image tokens) per image
TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 16 * 16, "longest_edge": 224 * 224},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True, "resample": 3,
}

# the video processor's (video_preprocessor_config.json): a total of at most 16,384 pixels over
# the sampled frames (8 frames of ~45 x 45: 4 steps of ~25 tokens), 4 to 16 frames at 2 fps
TINY_VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
    "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 16384},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True, "resample": 3, "do_sample_frames": True, "fps": 2,
    "min_frames": 4, "max_frames": 16,
}


def tiny_visual(hf: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random `model.visual.*` tensors at O(1) activations (fan-in scaled), so image features
    move the logits (a near-zero tower would hide position or merge-order bugs)."""
    with torch.device("meta"):
        names = {k: v.shape for k, v in VisionModel(VisionConfig.from_hf(hf)).state_dict().items()}
    out = {}
    for name, shape in names.items():
        if name.endswith("bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        elif "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "pos_embed.weight":
            t = torch.randn(shape, generator=gen)
        else:
            fan_in = torch.Size(shape)[1:].numel()
            t = torch.randn(shape, generator=gen) * fan_in ** -0.5
        out[f"model.visual.{name}"] = t
    return out


def write_tiny_processor(out: str | Path, hf: dict) -> None:
    """Tokenizer (with the vision tokens at the config's ids), chat template, preprocessor."""
    text = hf.get("text_config", hf)
    specials = {hf["vision_start_token_id"]: "<|vision_start|>",
                hf["vision_end_token_id"]: "<|vision_end|>",
                hf["image_token_id"]: "<|image_pad|>", hf["video_token_id"]: "<|video_pad|>"}
    write_tiny_tokenizer(out, text["vocab_size"], specials, VLM_CHAT_TEMPLATE)
    out = Path(out)
    pre = dict(TINY_PREPROCESSOR, patch_size=hf["vision_config"]["patch_size"],
               merge_size=hf["vision_config"]["spatial_merge_size"],
               temporal_patch_size=hf["vision_config"]["temporal_patch_size"])
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    video = dict(TINY_VIDEO_PREPROCESSOR, patch_size=pre["patch_size"],
                 merge_size=pre["merge_size"], temporal_patch_size=pre["temporal_patch_size"])
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    proc = {"processor_class": "Qwen3VLProcessor"}
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2))
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    tcfg.update(processor_class="Qwen3VLProcessor", image_token="<|image_pad|>",
                video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                vision_end_token="<|vision_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
