"""Qwen3-VL and Qwen3-VL-MoE (DeepStack: tower features from early blocks added to the first
decoder layers' outputs at the vision tokens), transformers' own classes the oracle: the tower's
features (main and DeepStack levels), the deployed graph's prompt logprobs with an image and a
video, greedy generation, speculation = plain, the released fused-expert layout and per-expert
keys, 2 ranks = one process."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.loading import load_model
from specdeploy.models import qwen3_vl
from tests.vision.conftest import rand_image
from tests.vision.video_util import rand_frames

transformers = pytest.importorskip("transformers")
IMAGE, VIDEO = 126, 127
KINDS = ("dense", "moe")
LIMITS = dict(max_batch_size=4, max_seq_len=512, max_num_tokens=16)  # chunks split the media


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (checkpoint dir, transformers model, plain deployment), built on first use."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            path = qwen3_vl.make_tiny(tmp_path_factory.mktemp(f"qwen3_vl_{kind}"), seed=5,
                                      moe=kind == "moe")
            hf, info = transformers.AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager",
                output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], info
            cache[kind] = (path, hf.eval(), LLM(path, **LIMITS))
        return cache[kind]

    return get


def _media_chat(seed: int = 0):
    return [{"role": "user", "content": [
        {"type": "image", "image": rand_image(37, 53, seed)},
        {"type": "text", "text": "and"},
        {"type": "video", "video": (rand_frames(10, 24, 32, seed + 1), {"fps": 4})},
        {"type": "text", "text": "what"}]}]


def _hf_inputs(llm, msgs, ids: list[int]) -> dict:
    """transformers' inputs for our expanded ids: our processors' pixels (their equality with
    transformers' processors is tests/vision/test_video_processor.py's)."""
    d = llm.deployed
    parts = msgs[0]["content"]
    pix = d.processor.preprocess([p["image"] for p in parts if p["type"] == "image"])
    clips = [d.video_processor.preprocess_one(p["video"]) for p in parts if p["type"] == "video"]
    t = torch.tensor([ids])
    out = dict(input_ids=t, attention_mask=torch.ones_like(t),
               mm_token_type_ids=(t == IMAGE).int() + 2 * (t == VIDEO).int(),
               pixel_values=pix.pixel_values, image_grid_thw=torch.tensor(pix.grid_thw))
    if clips:
        out.update(pixel_values_videos=torch.cat([c.pixel_values for c in clips]),
                   video_grid_thw=torch.tensor([c.grid_thw for c in clips]))
    return out


def test_config(tiny):
    path, _, _ = tiny("moe")
    hf = json.loads((path / "config.json").read_text())
    cfg = qwen3_vl.Config.from_hf(hf)
    assert (cfg.num_experts, cfg.deepstack_layers, cfg.mrope_section, cfg.qk_norm) == (
        8, 2, (4, 2, 2), True)
    assert not cfg.sparse(1) and cfg.sparse(0)
    bad = json.loads(json.dumps(hf))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 1]
    with pytest.raises(ValueError, match="mrope_section .* does not cover head_dim 16"):
        qwen3_vl.Config.from_hf(bad)
    bad["vision_config"]["deepstack_visual_indexes"] = [0, 3]
    from specdeploy.models.qwen3_5_vision import VisionConfig

    with pytest.raises(ValueError, match="deepstack_visual_indexes .* 3-block tower"):
        VisionConfig.from_hf(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_tower_features_equal_transformers(tiny, kind):
    """The main merger's and each DeepStack merger's features (fp32, 1e-5), side by side."""
    _, hf, llm = tiny(kind)
    d = llm.deployed
    pix = d.processor.preprocess([rand_image(37, 53, 3), rand_image(64, 30, 4)])
    grid = torch.tensor(pix.grid_thw)
    with torch.no_grad():
        out = hf.model.visual(pix.pixel_values, grid_thw=grid, return_dict=True)
        got = d.visual(pix.pixel_values, grid)
    want = torch.cat([out.pooler_output, *out.deepstack_features], -1)
    assert got.shape == want.shape == (want.shape[0], 64 * 3)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_with_an_image_and_a_video_equal_transformers(tiny, kind):
    """Every prompt position's logprob from the deployed graph (16-token prefill chunks: the
    DeepStack rows sliced across steps) = transformers' forward (fp32, 1e-4)."""
    _, hf, llm = tiny(kind)
    msgs = _media_chat(seed=7)
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ids = out.prompt_token_ids
    assert ids.count(IMAGE) > 16 and ids.count(VIDEO) > 16
    with torch.no_grad():
        logits = hf(**_hf_inputs(llm, msgs, ids)).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])  # id: logprob
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_deepstack_moves_the_logits(tiny, kind):
    """Guard for the tests above: the same prompt without the DeepStack levels gives logits
    far beyond their tolerance, so a deployment that dropped them would fail."""
    path, _, llm = tiny(kind)
    d = llm.deployed
    model = load_model(path, dtype=torch.float32)
    img = rand_image(37, 53, 3)
    from specdeploy.vision.chat import build_prompt

    tok = llm.tokenizer
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
    mm = build_prompt(d, tok.encode(text, add_special_tokens=False), [img], "p")
    with torch.no_grad():
        embeds = d.embed_tokens(torch.tensor([mm.ids]))
        embeds = torch.cat((embeds, embeds.new_zeros(*embeds.shape[:2], d.deepstack_width)), -1)
        embeds[0, mm.feature_row >= 0] = d.visual(mm.pixel_values, torch.tensor(mm.grid_thw))
        pos = mm.positions(0, mm.num_prompt)[:, None]
        full = model(None, pos, embeds)
        flat = model(None, pos, embeds[..., :64])
    assert (full - flat).abs().max() > 0.05 * full.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_an_image_and_a_video_equals_transformers(tiny, kind):
    _, hf, llm = tiny(kind)
    msgs = _media_chat(seed=1)
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=20, ignore_eos=True))
    inputs = _hf_inputs(llm, msgs, out.prompt_token_ids)
    hf.generation_config.eos_token_id = None
    ref = hf.generate(**inputs, max_new_tokens=20, do_sample=False)[0, len(
        out.prompt_token_ids):].tolist()
    assert out.token_ids == ref
    assert llm.deployed.target.graph_runner.replays > 0  # decode replayed (CPU graphs)


def _batch():
    return [_media_chat(seed=2), [{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image", "image": rand_image(64, 30, 5)}]}]]


@pytest.mark.parametrize("kind,method", [("dense", "eagle3"), ("moe", "ngram")])
def test_speculative_greedy_with_media_equals_plain(tiny, kind, method, tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    path, _, llm = tiny(kind)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in llm.chat(_batch(), sp)]
    spec = {"method": method, "num_speculative_tokens": 3, "controller": "off"}
    if method == "eagle3":
        spec["model"] = str(make_tiny_eagle3(path, tmp_path / "e3"))
    else:
        spec["prompt_lookup_max"] = 3
    fast = LLM(path, spec=spec, **LIMITS)
    assert [o.token_ids for o in fast.chat(_batch(), sp)] == want
    assert fast.stats()["draft_steps"] > 0


def test_per_expert_keys_load_as_the_fused_layout(tiny, tmp_path):
    """Per-expert keys (`mlp.experts.{e}.gate_proj.weight`, ...) give the released fused
    layout's logits; a checkpoint missing an expert names it."""
    from safetensors.torch import load_file, save_file

    path, _, _ = tiny("moe")
    tensors = load_file(str(path / "model.safetensors"))
    per: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I]
            base, i = k[: -len("gate_up_proj")], t.shape[2] // 2
            for e in range(t.shape[0]):
                per[f"{base}{e}.gate_proj.weight"] = t[e, :, :i].T.contiguous()
                per[f"{base}{e}.up_proj.weight"] = t[e, :, i:].T.contiguous()
        elif k.endswith("mlp.experts.down_proj"):  # [E, I, H]
            for e in range(t.shape[0]):
                per[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].T.contiguous()
        else:
            per[k] = t
    out = tmp_path / "per_expert"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(per, str(out / "model.safetensors"))
    ids = torch.randint(0, 120, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(path, dtype=torch.float32)(ids)
        assert torch.equal(load_model(out, dtype=torch.float32)(ids), want)
    del per["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(per, str(out / "model.safetensors"))
    from specdeploy.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.5\.up_proj"):
        load_model(out, dtype=torch.float32)


def test_two_ranks_give_the_one_process_tokens(tiny):
    """Qwen3-VL-MoE on 2 gloo ranks (rank 0's tower; the wider embeddings with the DeepStack
    levels go to rank 1 with each step; experts split over the ranks)."""
    path, _, llm = tiny("moe")
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in llm.chat(_batch(), sp)]
    tp = LLM(path, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.chat(_batch(), sp)] == want
    finally:
        tp.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_make_tiny_cli(arch, tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", arch, "--out", str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == [{"qwen3_vl": "Qwen3VLForConditionalGeneration",
                                    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}[arch]]
    assert hf["vision_config"]["deepstack_visual_indexes"] == [0, 1]


@pytest.mark.parametrize("method", ["nvfp4", "fp8-block"])
def test_quantized_checkpoint_with_an_image(method, tmp_path):
    """A pre-quantized Qwen3-VL-MoE (per-expert keys, the tower excluded as releases do): the
    deployed graph's prompt logprobs with an image = an independently dequantized copy's eager
    model on the deployment's tower features (these formats quantize weights only; fp32,
    1e-4)."""
    from specdeploy.quantize_cli import make_tiny_quantized
    from specdeploy.vision.chat import build_prompt
    from tests.checkpoint.quant_oracle import dequantize_dir

    path = make_tiny_quantized("qwen3_vl_moe", tmp_path / "q", method)
    dequantize_dir(path, tmp_path / "oracle")
    llm = LLM(path, **LIMITS)
    d = llm.deployed
    img = rand_image(37, 53, 3)
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
            "<|im_start|>assistant\n")
    out, = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0), images=[img])
    mm = build_prompt(d, llm.tokenizer.encode(text, add_special_tokens=False), [img], "p")
    ids = out.prompt_token_ids
    assert mm.ids == ids
    oracle = load_model(tmp_path / "oracle", dtype=torch.float32)
    with torch.no_grad():
        e = d.embed_tokens(torch.tensor([ids]))
        e = torch.cat((e, e.new_zeros(*e.shape[:2], d.deepstack_width)), -1)
        feats = d.visual(mm.pixel_values, torch.tensor(mm.grid_thw))
        e[0, mm.feature_row >= 0] = feats.to(e.dtype)
        logits = oracle(None, mm.positions(0, mm.num_prompt)[:, None], e)[0]
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    info = next(i for i in d.target.infos if i.name == "prequantized_weights")
    assert info.num_matches == 15 + 2


def test_quantized_fused_transposed_experts_are_refused(tiny, tmp_path):
    """Scales beside a released fused [E, H, 2I] expert tensor: which axis they scale is not
    a layout anyone documents, so it is refused by name rather than guessed."""
    from safetensors.torch import load_file, save_file

    from specdeploy.checkpoint import CheckpointError

    path, _, _ = tiny("moe")
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    tensors[key + "_weight_scale"] = torch.ones(8, 1, 1)
    out = tmp_path / "fused_q"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{key} is quantized in the fused, transposed"):
        load_model(out, dtype=torch.float32)
