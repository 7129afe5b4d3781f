"""A tiny Qwen3.5-MoE VLM (make-tiny: vision tower + MTP layer), transformers as its oracle, and
test images of several sizes and aspect ratios."""
from __future__ import annotations

import numpy as np
import pytest
import torch

IMAGE_TOKEN = 126  # tiny_hf_config's image_token_id


def rand_image(h: int, w: int, seed: int = 0, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    ch = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, ch), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if ch == 1 else arr, mode)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    from specdeploy.models.qwen3_5_moe import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_vlm"), seed=0, mtp_layers=1)


@pytest.fixture(scope="session")
def hf_vlm(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_image_processor(vlm_dir):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(vlm_dir)


def hf_inputs(hf_image_processor, ids: list[int], images) -> dict:
    """transformers' model inputs for our expanded ids: its own pixel values and grids."""
    pix = hf_image_processor(images, return_tensors="pt")
    t = torch.tensor([ids])
    return dict(input_ids=t, attention_mask=torch.ones_like(t),
                pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                mm_token_type_ids=(t == IMAGE_TOKEN).int())


@pytest.fixture(scope="session")
def vlm_llm(vlm_dir):
    """Plain deployment; 16 tokens per step, so prefill chunks split every image's tokens."""
    from specdeploy import LLM

    return LLM(vlm_dir, max_batch_size=4, max_seq_len=512, max_num_tokens=16)
