"""Gemma 3 as a vision-language model (`Gemma3ForConditionalGeneration`): a tiny random checkpoint
written by transformers' own classes (SigLIP tower on 56 x 56 images, 14-pixel patches, 4 image
tokens an image), against transformers in fp32: the preprocessor's pixels, every prompt
position's logprob with images (the image tokens attend bidirectionally within their image:
a causal variant is far off), greedy generation, n-gram and EAGLE-3 speculation = plain,
prefill chunks that would cut an image, a prefix-cache hit ending inside one, 2 tensor-parallel
ranks, the OpenAI server, text-only requests, the tower under the released names, `make-tiny
--arch gemma3_vl`, and refusals by name (GGUF: test_gguf_gemma3_vl.py; the cached op's image
blocks: tests/ops/test_image_block_attention.py).

Tolerance: |ours - transformers| <= 1e-4 * max(1, max |logprob|) (fp32, sums in other orders)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.models import gemma3
from tests.vision.conftest import rand_image

transformers = pytest.importorskip("transformers")
BOI, EOI, IMAGE = 124, 125, 126
LIMITS = dict(max_batch_size=4, max_seq_len=256)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True,
                "size": {"height": 56, "width": 56}, "resample": 2, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3, "do_convert_rgb": True, "do_pan_and_scan": False}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name or "post_layernorm" in name:
                p.copy_(1.0 + 0.1 * r if name.endswith("weight") else 0.02 * r)
            elif "norm" in name:  # Gemma RMSNorms: stored w, applied as 1 + w
                p.copy_(0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.02 * r)
            elif "embed_tokens" in name:
                p.copy_(0.3 * r)
            elif "position_embedding" in name:
                p.copy_(r)
            elif name.endswith("mm_input_projection_weight"):
                p.copy_(r * p.shape[0] ** -0.5)
            else:
                p.copy_(r * p.shape[1:].numel() ** -0.5)


def make_tiny_vlm(out, seed: int = 0, text_config: dict | None = None):
    text = {k: v for k, v in (text_config or gemma3.tiny_hf_config()).items()
            if k not in ("architectures", "torch_dtype")}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14,
                  layer_norm_eps=1e-6, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=4, boi_token_index=BOI,
                                    eoi_token_index=EOI, image_token_index=IMAGE)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    _randomize(model, seed)
    model.save_pretrained(out)
    write_tiny_tokenizer(out, 128, {BOI: "<start_of_image>", EOI: "<end_of_image>",
                                    IMAGE: "<image_soft_token>"}, TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_vlm(tmp_path_factory.mktemp("gemma3_vl"))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], **LIMITS)


def _chat(seed: int = 0, two: bool = True) -> list[dict]:
    parts = [{"type": "text", "text": "look"}, {"type": "image", "image": rand_image(37, 53, seed)},
             {"type": "text", "text": "and"}]
    if two:
        parts += [{"type": "image", "image": rand_image(64, 30, seed + 1)}]
    return [{"role": "user", "content": parts + [{"type": "text", "text": "what?"}]}]


def _images(msgs):
    return [p["image"] for m in msgs for p in m["content"] if p["type"] == "image"]


def _hf_inputs(ids, images, image_types: bool = True) -> dict:
    proc = transformers.AutoImageProcessor.from_pretrained(_hf_inputs.path)
    t = torch.tensor([ids])
    out = dict(input_ids=t, attention_mask=torch.ones_like(t),
               pixel_values=proc(images, return_tensors="pt")["pixel_values"])
    if image_types:
        out["token_type_ids"] = (t == IMAGE).long()
    return out


@pytest.fixture(autouse=True)
def _path(tiny):
    _hf_inputs.path = tiny[0]


def _logprobs(hf, ids, images, image_types=True) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(**_hf_inputs(ids, images, image_types)).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]


def _ours(out) -> torch.Tensor:
    ids = out.prompt_token_ids
    return torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])


def _err(got, want) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def test_preprocessor_equals_transformers(llm):
    proc = transformers.AutoImageProcessor.from_pretrained(_hf_inputs.path)
    imgs = [rand_image(37, 53, 0), rand_image(90, 31, 1, "RGBA"), rand_image(56, 56, 2, "L")]
    want = proc(imgs, return_tensors="pt")["pixel_values"]
    got = llm.deployed.processor.preprocess(imgs).pixel_values
    assert got.shape == want.shape == (3, 3, 56, 56)
    assert (got - want).abs().max() <= 1e-5


def test_prompt_expansion(llm):
    (out,) = llm.chat(_chat(), SamplingParams(max_tokens=1))
    ids = out.prompt_token_ids
    nl = llm.tokenizer.encode("\n\n", add_special_tokens=False)
    i = ids.index(BOI)
    assert ids[i - len(nl):i] == nl and ids[i + 1:i + 5] == [IMAGE] * 4 and ids[i + 5] == EOI
    assert ids[i + 6:i + 6 + len(nl)] == nl
    assert ids.count(IMAGE) == 8 and ids.count(BOI) == 2


@pytest.mark.parametrize("chunk", [None, 7, 3])
def test_prompt_logprobs_with_images_equal_transformers(tiny, chunk):
    """Every prompt position (two images, tokens 13-16 and 26-29), in one chunk and in chunks
    of at most 7 tokens, whose cuts at 14 and 28 would fall inside both images (the scheduler
    ends those chunks before each image, then takes it whole; without that rule the logprobs
    are off by ~4e-2), and in chunks of 3, fewer than an image's 4 tokens (each image goes in
    one step past the budget); a causal mask over the image tokens (transformers without
    token_type_ids) is far off, so a deployment attending causally could not pass."""
    path, hf = tiny
    llm = LLM(path, **LIMITS, **({} if chunk is None else {"max_num_tokens": chunk}))
    msgs = _chat(seed=3)
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ids = out.prompt_token_ids
    want = _logprobs(hf, ids, _images(msgs))
    assert _err(_ours(out), want) <= 1e-4
    causal = _logprobs(hf, ids, _images(msgs), image_types=False)
    assert _err(causal, want) > 100 * 1e-4


def test_chunks_never_end_inside_an_image(tiny):
    from specdeploy.vision.gemma3 import Gemma3Prompt

    mm = Gemma3Prompt([1, 2, IMAGE, IMAGE, IMAGE, IMAGE, 3], torch.zeros(1, 3, 56, 56),
                      [(1, 56, 56)], IMAGE)
    assert mm.chunk_tokens(0, 3) == 2  # before the image
    assert mm.chunk_tokens(2, 2) == 4  # the image whole, past the budget
    assert mm.chunk_tokens(0, 6) == 6 and mm.chunk_tokens(0, 7) == 7
    assert mm.key_extents(1, 3).tolist() == [0, 6, 6]


def test_greedy_with_images_equals_transformers_generate(tiny, llm):
    _, hf = tiny
    msgs = _chat(seed=5)
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=16, ignore_eos=True))
    n = len(out.prompt_token_ids)
    hf.generation_config.eos_token_id = None
    ref = hf.generate(**_hf_inputs(out.prompt_token_ids, _images(msgs)), max_new_tokens=16,
                      do_sample=False)[0, n:].tolist()
    assert out.token_ids == ref


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculation_with_images_equals_plain(tiny, llm, method, tmp_path):
    """A mixed batch (two images / text / one image), 16-token steps; the EAGLE-3 drafter (a
    tiny random one) reads the target's hidden states at the image rows too."""
    batch = [_chat(seed=6), [{"role": "user", "content": "hello hello hello"}],
             _chat(seed=8, two=False)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in llm.chat(batch, sp)]
    spec = {"method": method, "num_speculative_tokens": 3, "controller": "off"}
    if method == "eagle3":
        from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

        spec["model"] = str(make_tiny_eagle3(tiny[0], tmp_path / "e3"))
    else:
        spec["prompt_lookup_max"] = 3
    fast = LLM(tiny[0], **LIMITS, max_num_tokens=16, spec=spec)
    assert [o.token_ids for o in fast.chat(batch, sp)] == want
    assert fast.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(tiny, llm):
    """2 gloo ranks: rank 0's tower and embeddings, the key extents with each step's metadata."""
    batch = [_chat(seed=10), [{"role": "user", "content": "hello"}]]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.chat(batch, sp)]
    tp = LLM(tiny[0], tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.chat(batch, sp)] == want
    finally:
        tp.shutdown()


def test_text_only_requests_equal_transformers(tiny, llm):
    _, hf = tiny
    (out,) = llm.generate("hello there", SamplingParams(max_tokens=8, ignore_eos=True))
    t = torch.tensor([out.prompt_token_ids])
    hf.generation_config.eos_token_id = None
    ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=8,
                      do_sample=False)[0, t.shape[1]:].tolist()
    assert out.token_ids == ref


def test_prefix_hit_inside_an_image_equals_transformers(tiny):
    """4-token pages: the repeated prompt's hit (12 of its 16 tokens) ends inside the image
    (tokens 9-12), so the image's last token attends back to cached keys of its block."""
    _, hf = tiny
    llm = LLM(tiny[0], **LIMITS, page_size=4)
    img = rand_image(50, 41, 9)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate("abcdef<start_of_image>", sp, images=[img])[0]
    again = llm.generate("abcdef<start_of_image>", sp, images=[img])[0]
    ids = first.prompt_token_ids
    assert len(ids) == 16 and ids[9:13] == [IMAGE] * 4
    assert llm.stats()["prefix_cache_hits"] == 12
    hf.generation_config.eos_token_id = None
    ref = hf.generate(**_hf_inputs(ids, [img]), max_new_tokens=6, do_sample=False)[0, 16:]
    assert first.token_ids == again.token_ids == ref.tolist()


def test_generate_with_images_equals_chat(llm):
    img = rand_image(40, 24, 7)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "what"}]}]
    want = llm.chat(msgs, sp)[0].token_ids
    prompt = "<|im_start|>user\n<start_of_image>what<|im_end|>\n<|im_start|>assistant\n"
    assert llm.generate(prompt, sp, images=[img])[0].token_ids == want


def test_openai_server_image_equals_llm_chat(tiny):
    """`/v1/chat/completions` with an image_url data URL = `LLM.chat` on the same image."""
    import base64
    import io

    from specdeploy.serving.app import create_app
    from tests.serving.conftest import KEY, running

    llm = LLM(tiny[0], **LIMITS)
    img = rand_image(48, 33, 5)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    want = llm.chat(msgs, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with running(create_app(llm, model_name="g3", api_key=KEY)) as srv:
        r = srv.client().chat.completions.create(
            model="g3", messages=msgs, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("prefix", ["vision_tower.vision_model.", "model.vision_tower."])
def test_tower_reads_the_released_names(tiny, tmp_path, prefix):
    """The tower and projector under the released names (`vision_tower.vision_model.*`) and
    transformers' in-memory ones (`model.*`) give the features transformers' tower gives."""
    from safetensors.torch import load_file, save_file

    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.models.gemma3_vision import load_vision

    path, hf = tiny
    tensors = load_file(str(path / "model.safetensors"))
    proj = "model.multi_modal_projector." if prefix.startswith("model.") else (
        "multi_modal_projector.")
    renamed = {(prefix + k[len("vision_tower."):] if k.startswith("vision_tower.") else
                proj + k[len("multi_modal_projector."):]
                if k.startswith("multi_modal_projector.") else k): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tower = load_vision(open_checkpoint(tmp_path), torch.float32)
    pix = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.get_image_features(pix).pooler_output.reshape(-1, 64)
        assert (tower(pix) - want).abs().max() <= 1e-5 * want.abs().max()


def test_released_config_reads():
    """gemma-3-4b-it's vision settings: 64 x 64 patches pooled 4 x 4 into 256 tokens."""
    from specdeploy.models.gemma3_vision import VisionConfig
    from tests.models.test_gemma3 import MULTIMODAL_4B

    cfg = VisionConfig.from_hf(MULTIMODAL_4B)
    assert (cfg.grid, cfg.mm_tokens_per_image, cfg.hidden_size, cfg.text_hidden_size) == (
        64, 256, 1152, 2560)


def test_make_tiny_cli_writes_the_released_layout(tmp_path):
    """`make-tiny --arch gemma3_vl`: transformers loads it (the released names) without missing
    or unexpected keys, and the deployment's prompt logprobs with an image are its."""
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "gemma3_vl", "--out", str(tmp_path / "d")]) == 0
    path = tmp_path / "d"
    hf, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _hf_inputs.path = path
    msgs = _chat(seed=11, two=False)
    (out,) = LLM(path, **LIMITS).chat(msgs, SamplingParams(max_tokens=1, prompt_logprobs=0))
    want = _logprobs(hf.eval(), out.prompt_token_ids, _images(msgs))
    assert _err(_ours(out), want) <= 1e-4


def test_refusals_are_named(tiny, llm, tmp_path):
    from specdeploy.vision import ImageError

    with pytest.raises(ImageError, match=r"2 image\(s\) but 1 image placeholder"):
        llm.generate("<start_of_image>two?", images=[rand_image(8, 8), rand_image(8, 8)])
    with pytest.raises(ImageError, match="takes no videos"):
        llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
    with pytest.raises(ValueError, match="mm_processor_kwargs: 'max_pixels'"):
        llm.generate({"prompt": "<start_of_image>x", "multi_modal_data": {
            "image": rand_image(8, 8)}, "mm_processor_kwargs": {"max_pixels": 100}})
    from specdeploy.vision.gemma3 import Gemma3ImageProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR,
                                                                   "do_pan_and_scan": True}))
    with pytest.raises(ImageError, match="do_pan_and_scan=true is not supported"):
        Gemma3ImageProcessor.from_dir(tmp_path)
    from specdeploy.models.gemma3_vision import VisionConfig

    hf = json.loads((tiny[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="mm_tokens_per_image 9 does not pool"):
        VisionConfig.from_hf({**hf, "mm_tokens_per_image": 9})
    with pytest.raises(ValueError, match="vision_use_head=true"):
        VisionConfig.from_hf({**hf, "vision_config": {**hf["vision_config"],
                                                      "vision_use_head": True}})
