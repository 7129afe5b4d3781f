"""Gemma 3 (`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`):
logits = transformers' class in fp32 on a tiny checkpoint (sliding window 8 < the sequence,
local RoPE base, linear scaling on the full layers, a score scale other than head_dim's); the
windows, the local base, the score scale and the softcap each move transformers' logits far
more than the tolerance; released configs read as transformers reads them; greedy = `generate`;
n-gram and EAGLE-3 speculation lossless; a softcapped deployment's logprobs = transformers', on
2 ranks its tokens = `generate`; bad configs and missing tensors named.

Tolerance: max |ours - transformers| <= 1e-4 * max |logit| (fp32; sums in other orders)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import gemma3

transformers = pytest.importorskip("transformers")
RTOL = 1e-4
LIMITS = dict(max_batch_size=4, max_seq_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = gemma3.make_tiny(tmp_path_factory.mktemp("gemma3"), seed=3)
    return path, _hf(path)


def _hf(path, **config_changes):
    cfg = transformers.AutoConfig.from_pretrained(path)
    for key, value in config_changes.items():
        setattr(cfg, key, value)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=cfg, dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("b,t", [(1, 1), (1, 37), (2, 30)])
def test_logits_equal_transformers(tiny, b, t):
    path, hf = tiny
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = load_model(path, dtype=torch.float32)(ids)
    assert _err(got, want) <= RTOL
    assert want.abs().mean() > 0.1


def test_yarn_on_the_full_layers_equals_transformers(tiny, tmp_path):
    """`rope_scaling` yarn (models/layers.py RopeConfig) scales the full layers' RoPE only."""
    path, _ = tiny
    hf = {**json.loads((path / "config.json").read_text()), "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    ref = _hf(tmp_path)
    assert ref.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    ids = _ids(1, 60, seed=2)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert _err(load_model(tmp_path, dtype=torch.float32)(ids), want) <= RTOL
        assert _err(load_model(path, dtype=torch.float32)(ids), want) > 100 * RTOL


def test_windows_local_rope_and_scale_change_the_logits(tiny):
    """transformers' own model with full attention everywhere, with the global RoPE base on the
    sliding layers too, or with head_dim's score scale gives logits far outside the tolerance:
    a model ignoring any of them could not pass the test above."""
    path, hf = tiny
    ids = _ids(1, 40, seed=1)  # 40 > the window of 8
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        full = _hf(path, layer_types=["full_attention"] * 4)
        assert _err(full(input_ids=ids).logits, want) > 100 * RTOL
        rope = transformers.AutoConfig.from_pretrained(path).rope_parameters
        rope["sliding_attention"]["rope_theta"] = rope["full_attention"]["rope_theta"]
        assert _err(_hf(path, rope_parameters=rope)(input_ids=ids).logits, want) > 100 * RTOL
        scale = _hf(path, query_pre_attn_scalar=16)
        assert _err(scale(input_ids=ids).logits, want) > 100 * RTOL


def test_greedy_equals_generate_ngram_and_eagle3_are_lossless(tiny, tmp_path):
    """(EAGLE-3: a random head on layers captured through the post-norm residual adds.)"""
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    path, hf = tiny
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    got = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, sp)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    spec = LLM(path, spec={"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 2, "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == got
    assert spec.stats()["draft_steps"] > 0
    head = make_tiny_eagle3(path, tmp_path / "eagle3", seed=0)
    eagle = LLM(path, spec={"method": "eagle3", "draft_model": str(head),
                            "num_draft_tokens": 3, "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in eagle.generate(prompts, sp)] == got
    assert eagle.stats()["draft_steps"] > 0


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """final_logit_softcapping (null in the releases): tanh(logits / c) * c, c = 1.5."""
    path = gemma3.make_tiny(tmp_path_factory.mktemp("gemma3_cap"), seed=4, hf_config={
        **gemma3.tiny_hf_config(), "final_logit_softcapping": 1.5})
    return path, _hf(path)


def test_softcapped_logits_and_deployed_logprobs_equal_transformers(capped):
    """Eager logits, and the deployment's prompt logprobs (its head gathered before the cap)
    against transformers' log-softmax (2e-4 absolute, as tests/engine/test_prompt_logprobs.py)."""
    path, hf = capped
    prompt = _ids(1, 33, seed=5)
    with torch.no_grad():
        want = hf(input_ids=prompt).logits
        assert _err(_hf(path, final_logit_softcapping=None)(input_ids=prompt).logits,
                    want) > 100 * RTOL
        assert _err(load_model(path, dtype=torch.float32)(prompt), want) <= RTOL
    ref = want[0].log_softmax(-1)
    out = LLM(path, **LIMITS).generate([prompt[0].tolist()],
                                       SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    for i, tok in enumerate(prompt[0].tolist()[1:], 1):
        assert abs(out.prompt_logprobs[i][tok] - ref[i - 1, tok].item()) <= 2e-4


def test_two_ranks_give_transformers_tokens(capped):
    """Heads split over 2 ranks, the tied head vocab-parallel (gathered before the cap)."""
    path, hf = capped
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    tp = LLM(path, tensor_parallel_size=2, dist_timeout=60, **LIMITS)
    try:
        got = [o.token_ids for o in tp.generate(prompts, SamplingParams(max_tokens=16,
                                                                        ignore_eos=True))]
    finally:
        tp.shutdown()
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=16, do_sample=False)[0, len(p):].tolist()


# google/gemma-3-1b-it's config.json as released; a 4b-style multimodal one (its text_config
# leaves most keys to transformers' defaults)
RELEASED_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144}
MULTIMODAL_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


@pytest.mark.parametrize("released", [RELEASED_1B, MULTIMODAL_4B], ids=["1b", "4b"])
def test_released_configs_read_as_transformers(released):
    """Shapes, windows, score scale and both RoPE tables (bit-equal to transformers')."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    ref = transformers.AutoConfig.for_model(**released)
    ref = getattr(ref, "text_config", ref)
    cfg = gemma3.Config.from_hf(released)
    assert cfg.windows == tuple(ref.sliding_window if t == "sliding_attention" else 0
                                for t in ref.layer_types)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.query_pre_attn_scalar, cfg.tie_word_embeddings) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim, ref.rms_norm_eps,
        ref.query_pre_attn_scalar, ref.tie_word_embeddings)
    rotary = Gemma3RotaryEmbedding(ref)
    assert torch.equal(cfg.rope.inv_freq(cfg.head_dim), rotary.full_attention_inv_freq)
    assert torch.equal(cfg.local_rope.inv_freq(cfg.head_dim), rotary.sliding_attention_inv_freq)


def test_v5_config_as_transformers_saves_it_reads_the_same():
    """`rope_parameters` keyed by layer type and explicit `layer_types` (transformers v5's
    `to_dict`) = the released v4 keys they came from."""
    v5 = transformers.AutoConfig.for_model(**gemma3.tiny_hf_config()).to_dict()
    assert "full_attention" in v5["rope_parameters"] and "rope_scaling" not in v5
    assert gemma3.Config.from_hf(v5) == gemma3.Config.from_hf(gemma3.tiny_hf_config())


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_checkpoint_serves_its_language_model(tiny, tmp_path, prefix):
    """The tiny model's tensors under a multimodal checkpoint's names (as released:
    `language_model.model.*`; as transformers v5 saves it: `model.language_model.*`), a vision
    tower beside them, config nested in `text_config`: transformers' logits."""
    from safetensors.torch import load_file

    path, hf = tiny
    text = json.loads((path / "config.json").read_text())
    tensors = {prefix + k[len("model."):]: v
               for k, v in load_file(str(path / "model.safetensors")).items()}
    assert len(tensors) == 2 + 13 * text["num_hidden_layers"]  # every tensor renamed
    tower = "vision_tower." if prefix.startswith("language_model") else "model.vision_tower."
    tensors[tower + "vision_model.post_layernorm.weight"] = torch.ones(8)
    write_checkpoint(tmp_path, {**MULTIMODAL_4B, "text_config": text}, tensors)
    write_tiny_tokenizer(tmp_path, text["vocab_size"])
    ids = _ids(1, 20, seed=2)
    with torch.no_grad():
        assert _err(load_model(tmp_path, dtype=torch.float32)(ids), hf(input_ids=ids).logits
                    ) <= RTOL


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "rope_parameters must be keyed by layer type"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "unsupported rope type 'dynamic'"),
    ({"hidden_activation": "gelu_new"}, "unsupported activation 'gelu_new'"),
])
def test_bad_configs_are_named(tiny, tmp_path, change, match):
    path, _ = tiny
    (tmp_path / "config.json").write_text(json.dumps({**gemma3.tiny_hf_config(), **change}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, dtype=torch.float32)


def test_missing_tensor_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.post_feedforward_layernorm.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"missing: model\.layers\.2\.post_feedforward_layernorm\.weight"):
        load_model(tmp_path, dtype=torch.float32)


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "gemma3", "--out", str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Gemma3ForCausalLM"]
