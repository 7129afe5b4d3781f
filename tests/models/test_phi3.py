"""Phi-3 / 3.5 / 4 (`Phi3ForCausalLM`): logits = transformers' class in fp32 (fused q/k/v and
gate/up tensors split at load; partial RoPE; LongRoPE; a sliding window on every layer), the
LongRoPE tables = transformers' rotary embedding's at both factor sets, greedy = `generate`,
n-gram speculation lossless, bad checkpoints named.

Tolerance: max |ours - transformers| <= 1e-4 * max |logit| (fp32, sums in other orders)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.loading import load_model
from specdeploy.models import phi3

transformers = pytest.importorskip("transformers")
RTOL = 1e-4
LIMITS = dict(max_batch_size=2, max_seq_len=128)
# Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE; every layer windowed
MINI = {"partial_rotary_factor": 0.75, "sliding_window": 8, "original_max_position_embeddings": 64,
        "max_position_embeddings": 512,
        "rope_scaling": {"rope_type": "longrope",
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]}}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    plain = phi3.make_tiny(d / "plain", seed=1)
    mini = phi3.make_tiny(d / "mini", seed=2, config_overrides=MINI)
    return {"plain": (plain, _hf(plain)), "mini": (mini, _hf(mini))}


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("which", ["plain", "mini"])
def test_logits_equal_transformers(models, which):
    path, hf = models[which]
    ours = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, 124, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert _err(ours(ids), want) <= RTOL
        if which == "mini":  # the guard: the windows and LongRoPE's factors move the logits
            hf.config.sliding_window = None
            try:
                assert _err(hf(input_ids=ids).logits, want) > 1e-2
            finally:
                hf.config.sliding_window = MINI["sliding_window"]


def test_longrope_tables_equal_transformers_at_both_factor_sets(models):
    """Positions below the original context: transformers' short-factor table; from it on (a
    forward reaching past it, where transformers switches the whole table): its long one."""
    path, hf = models["mini"]
    ours = load_model(path, dtype=torch.float32).model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    near = torch.arange(60)[None]
    far = torch.arange(100)[None]
    c, s = ours(near)
    hc, hs = hf.model.rotary_emb(x, near)
    torch.testing.assert_close((c, s), (hc, hs), rtol=0, atol=1e-6)
    c, s = ours(far)
    hc, hs = hf.model.rotary_emb(x, far)  # (max position 99 >= 64: the long factors)
    torch.testing.assert_close((c[:, 64:], s[:, 64:]), (hc[:, 64:], hs[:, 64:]), rtol=0,
                               atol=1e-6)
    assert (c[:, :64] - hc[:, :64]).abs().max() > 1e-2  # short there, as within the context


def test_greedy_equals_generate_and_ngram_is_lossless(models):
    path, hf = models["mini"]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    got = [o.token_ids for o in LLM(str(path), **LIMITS).generate(prompts, sp)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                                "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == got
    assert spec.stats()["draft_steps"] > 0


def test_bad_checkpoints_are_named(models, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = models["plain"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(bad, dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0] * 3,
                           "long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="short_factor must be a list of 8 numbers"):
        phi3.Config.from_hf(cfg)
