"""The deployed VLM (exported language model + eager tower) against transformers' greedy
generate, MTP speculation with image prompts against plain decoding, and every image input."""
from __future__ import annotations

import base64
import io

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.vision import ImageError
from tests.vision.conftest import hf_inputs, rand_image

GREEDY32 = SamplingParams(max_tokens=32, ignore_eos=True)


def _two_images_chat(a, b) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image", "image": a}, {"type": "text", "text": "hi there"},
        {"type": "image", "image": b}, {"type": "text", "text": "ok"}]}]


def _batch():
    a, b = rand_image(37, 53, 0), rand_image(64, 30, 1)
    return [_two_images_chat(a, b), [{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image", "image": b}]}]]


@pytest.fixture(scope="module")
def plain_outputs(vlm_llm):
    return [o.token_ids for o in vlm_llm.chat(_batch(), GREEDY32)]


def test_greedy_with_images_equals_transformers_generate(vlm_llm, hf_vlm, hf_image_processor):
    """32 greedy tokens; prefill in 16-token chunks, so the image features are sliced across
    chunks and decode runs at position + the mRoPE delta."""
    a, b = rand_image(37, 53, 0), rand_image(64, 30, 1)
    (out,) = vlm_llm.chat(_two_images_chat(a, b), GREEDY32)
    inputs = hf_inputs(hf_image_processor, out.prompt_token_ids, [a, b])
    n = len(out.prompt_token_ids)
    assert n > 40  # chunked: several steps cover the 35 + 32 image tokens
    hf_vlm.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens masks eos)
    ref = hf_vlm.generate(**inputs, max_new_tokens=32, do_sample=False)[0, n:].tolist()
    assert out.token_ids == ref


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_with_images_equals_plain(vlm_dir, plain_outputs, k):
    """Mixed batch (two images / text only / one image), chunked prefill splitting images."""
    llm = LLM(vlm_dir, max_batch_size=4, max_seq_len=512, max_num_tokens=16,
              spec={"method": "mtp", "num_draft_tokens": k})
    got = [o.token_ids for o in llm.chat(_batch(), GREEDY32)]
    assert got == plain_outputs
    assert llm.stats()["draft_steps"] > 0


def test_image_sources_agree(vlm_llm, tmp_path):
    """Data URL, file path, file:// URL and PIL image give the same output; `generate` with
    images beside a prompt matches `chat`."""
    img = rand_image(40, 24, 7)
    path = tmp_path / "x.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = []
    for src in (img, str(path), f"file://{path}", url):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": src}}
                                             if isinstance(src, str) else
                                             {"type": "image", "image": src},
                                             {"type": "text", "text": "what"}]}]
        outs.append(vlm_llm.chat(msgs, sp)[0].token_ids)
    assert all(o == outs[0] for o in outs)
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert vlm_llm.generate(prompt, sp, images=[path])[0].token_ids == outs[0]


TWO = SamplingParams(max_tokens=2)


def _chat_image(llm, src, sp=TWO):
    return llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": src}}, {"type": "text", "text": "x"}]}], sp)


def test_bad_images_are_refused_by_name(vlm_llm, tmp_path):
    from PIL import Image

    notimg = tmp_path / "a.png"
    notimg.write_bytes(b"this is not an image")
    buf = io.BytesIO()
    rand_image(64, 64).save(buf, format="PNG")
    trunc = tmp_path / "t.png"
    trunc.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageError, match="not an image"):
        _chat_image(vlm_llm, str(notimg))
    with pytest.raises(ImageError, match="cannot decode"):
        _chat_image(vlm_llm, str(trunc))
    with pytest.raises(ImageError, match="zero-sized"):
        vlm_llm.chat([{"role": "user", "content": [
            {"type": "image", "image": Image.new("RGB", (0, 4))}]}])
    with pytest.raises(ImageError, match="remote URLs are not fetched"):
        _chat_image(vlm_llm, "https://example.com/cat.png")
    with pytest.raises(ImageError, match="invalid base64"):
        _chat_image(vlm_llm, "data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="no such file"):
        _chat_image(vlm_llm, str(tmp_path / "missing.png"))
    with pytest.raises(ImageError, match="not a video"):
        vlm_llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
    with pytest.raises(ValueError, match="video placeholder tokens .* but no videos"):
        vlm_llm.generate("<|video_pad|>none?")
    with pytest.raises(ImageError, match=r"2 image\(s\) but 1 image placeholder"):
        vlm_llm.generate("<|image_pad|>two?", images=[rand_image(8, 8), rand_image(8, 8)])
    with pytest.raises(ValueError, match="placeholder tokens .* but no images"):
        vlm_llm.generate("<|image_pad|>none?")
    assert vlm_llm.engine.has_unfinished() is False
    # other requests are unaffected
    assert len(vlm_llm.generate("hello", SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_too_many_pixels(vlm_dir):
    from specdeploy.vision import ImageProcessor

    proc = ImageProcessor.from_dir(vlm_dir)
    small = type(proc)(**{**proc.__dict__, "max_input_pixels": 1000})
    with pytest.raises(ImageError, match=r"image 0: too many pixels \(40x30 > 1000\)"):
        small.preprocess([rand_image(30, 40)])


def test_report_names_the_vision_peak(vlm_llm):
    assert "vision tower: eager, activations peak" in vlm_llm.deployed.report()
    assert vlm_llm.deployed.vision_peak_bytes > 0


def test_text_model_refuses_images():
    from specdeploy.vision.chat import build_prompt

    with pytest.raises(ImageError, match="no vision tower"):
        build_prompt(object(), [1, 2], [rand_image(8, 8)])


def test_features_computed_once_per_request(vlm_llm):
    calls = []
    tower = vlm_llm.deployed.visual
    hook = tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        vlm_llm.chat([{"role": "user", "content": [
            {"type": "image", "image": rand_image(64, 30)}]}], TWO)
    finally:
        hook.remove()
    assert len(calls) == 1  # 32 image tokens over 16-token chunks: one tower call
    assert torch.is_tensor(tower.pos_embed.weight)


def test_cli_generate_with_image(vlm_dir, vlm_llm, tmp_path, capsys):
    import json

    from specdeploy.cli import main

    path = tmp_path / "c.png"
    rand_image(30, 45, 9).save(path)
    assert main(["generate", "--model", str(vlm_dir), "--chat", "--image", str(path),
                 "--prompt", "what", "--max-tokens", "6", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                         {"type": "text", "text": "what"}]}]
    want = vlm_llm.chat(msgs, SamplingParams(max_tokens=6))[0]
    assert got["token_ids"] == want.token_ids
    assert main(["generate", "--model", str(vlm_dir), "--chat", "--image", str(tmp_path / "no"),
                 "--prompt", "x"]) == 2
    assert "--image" in capsys.readouterr().err
