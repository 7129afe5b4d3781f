"""Liquid AI LFM2 (`Lfm2ForCausalLM`): a tiny 6-layer checkpoint (4 gated short-conv layers, 2
attention layers with q / k norms, an auto-adjusted FFN width) against transformers' own class:
logits (fp32, max |ours - transformers| <= 1e-4 * max |logit|); the deployed engine's prompt
logprobs with chunked prefill (16-token chunks, 2e-4 absolute as
tests/engine/test_prompt_logprobs.py); greedy = `generate`; n-gram speculation lossless with
drafts rejected (the conv states roll back); a prefix-cache hit; 2 ranks = one process; a
checkpoint transformers wrote (conv biases); released configs read as transformers reads them;
bad layer types and missing tensors named."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import lfm2

transformers = pytest.importorskip("transformers")
RTOL = 1e-4
LIMITS = dict(max_batch_size=4, max_seq_len=256, max_num_tokens=16)  # 16-token prefill chunks
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = lfm2.make_tiny(tmp_path_factory.mktemp("lfm2"), seed=1)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return path, hf.eval()


@pytest.fixture(scope="module")
def plain(tiny):
    return LLM(tiny[0], **LIMITS)


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("b,t", [(1, 1), (1, 37), (2, 30)])
def test_logits_equal_transformers(tiny, b, t):
    path, hf = tiny
    assert hf.config.layer_types.count("conv") == 4
    assert hf.model.layers[0].feed_forward.w1.out_features == 160  # (96 before the adjustment)
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = load_model(path, dtype=torch.float32)(ids)
    assert _err(got, want) <= RTOL
    assert want.abs().mean() > 0.1


def test_deployed_prompt_logprobs_with_chunked_prefill(tiny, plain):
    """A 45-token prompt prefilled in 16-token chunks beside a short one: each chunk starts
    from the conv states (and KV) the previous one left."""
    _, hf = tiny
    prompts = [_ids(1, 45, seed=11)[0].tolist(), _ids(1, 7, seed=12)[0].tolist()]
    outs = plain.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=0))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p])).logits[0].log_softmax(-1)
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for i, tok in enumerate(p[1:], 1):
            assert abs(out.prompt_logprobs[i][tok] - ref[i - 1, tok].item()) <= 2e-4, i


def test_greedy_equals_generate_and_ngram_is_lossless(tiny, plain):
    path, hf = tiny
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], _ids(1, 40, seed=3)[0].tolist(),
               [40, 41, 40, 41, 40, 41, 40]]
    got = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    spec = LLM(path, spec={"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 2, "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == got
    s = spec.engine.spec_stats
    # drafts both accepted and rejected: the committed conv states were rolled back
    assert 0 < s.accepted_tokens < s.draft_tokens, (s.accepted_tokens, s.draft_tokens)


def test_prefix_cache_resumes_from_the_conv_checkpoints(tiny, plain):
    """A prompt extending a served one starts from its cached pages and the conv / KV state
    checkpointed there, and still decodes transformers' greedy tokens."""
    _, hf = tiny
    base = _ids(1, 50, seed=21)[0].tolist()
    plain.generate([base], GREEDY)
    before = plain.stats()["prefix_cache_hits"]
    prompt = base + [7, 8, 9]
    got = plain.generate([prompt], GREEDY)[0].token_ids
    assert plain.stats()["prefix_cache_hits"] > before
    hf.generation_config.eos_token_id = None
    t = torch.tensor([prompt])
    assert got == hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=20,
                              do_sample=False)[0, len(prompt):].tolist()


def test_two_ranks_give_the_one_process_tokens(tiny, plain):
    """The sharding hints: conv channels (in_proj's B / C / x thirds, the depthwise conv,
    out_proj's columns), attention heads, the FFN width split over 2 ranks."""
    prompts = ["hello there", "a b c d e f"]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    tp = LLM(tiny[0], tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.shutdown()


def test_a_checkpoint_transformers_wrote(tmp_path):
    """transformers' own `save_pretrained` (its names) of a model with conv biases and
    `full_attn_idxs` in place of `layer_types`."""
    hf = {k: v for k, v in lfm2.tiny_hf_config().items()
          if k not in ("architectures", "model_type", "torch_dtype", "layer_types")}
    cfg = transformers.Lfm2Config(**{**hf, "conv_bias": True}, full_attn_idxs=[1, 4])
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("bias") else p.shape[-1] ** -0.5
            p.copy_(("norm" in name) + torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, cfg.vocab_size)
    ours = load_model(tmp_path, dtype=torch.float32)
    assert ours.cfg.conv_bias and ours.cfg.layer_types[1] == "full_attention"
    ids = _ids(2, 25, seed=4)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        assert _err(ours(ids), model(input_ids=ids).logits) <= RTOL


# LFM2-350M's config.json keys as released (v4-style names: block_ff_dim, tie_embedding,
# full_attn_idxs beside layer_types); then the other sizes' FFN settings
RELEASED_350M = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "block_auto_adjust_ff_dim": True,
    "block_dim": 1024, "block_ff_dim": 6656, "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256, "conv_L_cache": 3, "conv_bias": False, "hidden_size": 1024,
    "intermediate_size": 6656, "max_position_embeddings": 128000, "norm_eps": 1e-05,
    "num_attention_heads": 16, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rope_theta": 1000000.0, "tie_embedding": True, "vocab_size": 65536,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                    for i in range(16)]}


@pytest.mark.parametrize("change", [
    {}, {"layer_types": None},
    {"hidden_size": 1536, "block_ff_dim": 10240, "intermediate_size": 10240},
    {"hidden_size": 2048, "block_ff_dim": 12288, "intermediate_size": 12288},
    {"block_ffn_dim_multiplier": 1.3, "block_multiple_of": 100},
    {"block_auto_adjust_ff_dim": False},
], ids=["350m", "idxs", "700m", "1.2b", "mult", "no-adjust"])
def test_released_configs_read_as_transformers(change):
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP, Lfm2RotaryEmbedding

    released = {k: v for k, v in {**RELEASED_350M, **change}.items() if v is not None}
    ref = transformers.AutoConfig.for_model(**released)
    cfg = lfm2.Config.from_hf(released)
    with torch.device("meta"):
        width = Lfm2MLP(ref).w1.out_features
    assert cfg.intermediate_size == width
    assert cfg.layer_types == tuple(ref.layer_types)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.norm_eps,
            cfg.conv_L_cache, cfg.tie_word_embeddings) == (
        ref.hidden_size, ref.num_attention_heads, ref.num_key_value_heads, ref.norm_eps,
        ref.conv_L_cache, ref.tie_word_embeddings)
    assert torch.equal(cfg.rope.inv_freq(cfg.head_dim), Lfm2RotaryEmbedding(ref).inv_freq)


def test_bad_layer_type_is_named():
    hf = lfm2.tiny_hf_config()
    with pytest.raises(ValueError, match=r"LFM2: layer types \['sliding_attention'\]"):
        lfm2.Config.from_hf({**hf, "layer_types": ["conv"] * 5 + ["sliding_attention"]})
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 layers"):
        lfm2.Config.from_hf({**hf, "layer_types": ["conv"] * 2})
    with pytest.raises(ValueError, match="no MTP head"):
        lfm2.Model(lfm2.Config.from_hf(hf), with_mtp=True)


def test_missing_tensor_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.3.conv.conv.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.3\.conv\.conv\.weight"):
        load_model(tmp_path, dtype=torch.float32)


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "lfm2", "--out", str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Lfm2ForCausalLM"]
