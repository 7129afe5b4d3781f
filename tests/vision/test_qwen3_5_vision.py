"""The vision tower, mRoPE positions and preprocessing against transformers (fp32)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy.checkpoint import open_checkpoint
from specdeploy.deploy.vlm import load_vision
from specdeploy.loading import load_model
from specdeploy.tokenizer import load_tokenizer
from specdeploy.vision import ImageProcessor, MultimodalPrompt
from tests.vision.conftest import IMAGE_TOKEN, hf_inputs, rand_image

SIZES = [(37, 53), (64, 30), (5, 7), (300, 200), (16, 16), (20, 180), (224, 224), (61, 250)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocess_equals_transformers(vlm_dir, hf_image_processor, mode):
    ours = ImageProcessor.from_dir(vlm_dir)
    for i, (h, w) in enumerate(SIZES):
        img = rand_image(h, w, seed=i, mode=mode)
        ref = hf_image_processor([img], return_tensors="pt")
        got = ours.preprocess([img])
        assert got.grid_thw == [tuple(ref["image_grid_thw"][0].tolist())], (h, w)
        # same PIL resize, same float32 arithmetic: equal to the last bit
        torch.testing.assert_close(got.pixel_values, ref["pixel_values"], rtol=0, atol=0)


def test_preprocess_several_images_in_order(vlm_dir, hf_image_processor):
    imgs = [rand_image(37, 53, 1), rand_image(300, 200, 2), rand_image(5, 7, 3)]
    ref = hf_image_processor(imgs, return_tensors="pt")
    got = ImageProcessor.from_dir(vlm_dir).preprocess(imgs)
    assert got.grid_thw == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    torch.testing.assert_close(got.pixel_values, ref["pixel_values"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def ours(vlm_dir):
    reader = open_checkpoint(vlm_dir)
    return load_model(vlm_dir), load_vision(reader, torch.float32), load_tokenizer(vlm_dir)


def _prompt(tok, vlm_dir, text: str, images) -> MultimodalPrompt:
    ids = tok.encode(text, add_special_tokens=False)
    pix = ImageProcessor.from_dir(vlm_dir).preprocess(images)
    return MultimodalPrompt.build(ids, pix, IMAGE_TOKEN, 2)


@pytest.mark.parametrize("sizes", [[(37, 53)], [(37, 53), (64, 30)]], ids=["1img", "2img"])
def test_prefill_logits_equal_transformers(vlm_dir, ours, hf_vlm, hf_image_processor, sizes):
    model, tower, tok = ours
    images = [rand_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    text = "<|im_start|>user\n" + "".join(f"{PAD}pic{i}" for i in range(len(images))) + \
        "ok<|im_end|>\n<|im_start|>assistant\n"
    mm = _prompt(tok, vlm_dir, text, images)
    inputs = hf_inputs(hf_image_processor, mm.ids, images)
    with torch.no_grad():
        ref = hf_vlm(**inputs).logits
        pos, delta = hf_vlm.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 inputs["image_grid_thw"])
        feats = tower(mm.pixel_values, torch.tensor(mm.grid_thw))
        embeds = model.model.embed_tokens(inputs["input_ids"])
        embeds[0, inputs["input_ids"][0] == IMAGE_TOKEN] = feats
        got = model(None, mm.positions(0, mm.num_prompt)[:, None], embeds)
    assert torch.equal(mm.positions(0, mm.num_prompt)[:, None], pos)
    assert mm.delta == int(delta)
    assert (got - ref).abs().max() <= 1e-4
    assert ref.abs().mean() > 0.1  # real numbers, not near-zero logits


def test_positions_past_the_prompt_continue_with_delta(vlm_dir, ours):
    _, _, tok = ours
    mm = _prompt(tok, vlm_dir, f"a{PAD}b", [rand_image(64, 30)])
    n = mm.num_prompt
    tail = mm.positions(n - 2, 5)
    assert torch.equal(tail[:, :2], mm.prompt_positions[:, n - 2:])
    assert torch.equal(tail[:, 2:], (torch.arange(n, n + 3) + mm.delta).expand(3, -1))
    assert mm.delta < 0  # a 16 x 8 patch grid takes 32 tokens but advances positions by 4


def test_make_tiny_is_a_transformers_vlm(vlm_dir, hf_vlm):
    """The directory loads as transformers' VLM with every vision weight (no random init) and
    declares the Qwen3-VL processor; the image tokens are special tokens of its tokenizer."""
    from transformers import AutoTokenizer

    assert type(hf_vlm).__name__ == "Qwen3_5MoeForConditionalGeneration"
    reader = open_checkpoint(vlm_dir)
    for name, p in hf_vlm.model.visual.state_dict().items():
        if f"model.visual.{name}" in reader.keys():
            assert torch.equal(p, reader.get(f"model.visual.{name}")), name
    assert json.loads((vlm_dir / "preprocessor_config.json").read_text())["processor_class"] \
        == "Qwen3VLProcessor"
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]) \
        == [124, 126, 125]
    rendered = load_tokenizer(vlm_dir).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    assert PAD + "hi" in rendered


def test_tower_features_equal_transformers(vlm_dir, ours, hf_vlm, hf_image_processor):
    """Several images of different sizes in one call (each attends only to itself)."""
    _, tower, _ = ours
    images = [rand_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES[:4])]
    inputs = hf_image_processor(images, return_tensors="pt")
    with torch.no_grad():
        ref = hf_vlm.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        got = tower(inputs["pixel_values"], inputs["image_grid_thw"])
    assert (got - torch.cat(ref.pooler_output)).abs().max() <= 1e-6
