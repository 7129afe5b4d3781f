"""Llama family vs transformers' LlamaForCausalLM (fp32) on tiny sharded checkpoints."""
from __future__ import annotations

import pytest
import torch

from specdeploy.checkpoint import open_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import llama
from specdeploy.models.layers import RopeConfig

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope_bias": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
                         "attention_bias": True, "mlp_bias": True},
    "mha_wide_head": {"num_key_value_heads": 4, "head_dim": 24, "rms_norm_eps": 1e-6,
                      "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # Qwen2.5 / Qwen3's long-context setting (positions below run past the original 32)
    "yarn_rope": {"rope_scaling": YARN_ROPE, "max_position_embeddings": 256},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = llama.make_tiny(tmp_path_factory.mktemp(request.param), seed=1,
                           config_overrides=VARIANTS[request.param], max_shard_bytes=40_000)
    assert len(list(path.glob("*.safetensors"))) > 1  # really sharded
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, load_model(path), ref


@pytest.mark.parametrize("batch,length,offset", [(1, 1, 0), (1, 17, 0), (3, 33, 5), (2, 64, 90)])
def test_logits_match_transformers(pair, batch, length, offset):
    _, ours, ref = pair
    g = torch.Generator().manual_seed(batch * 100 + length)
    ids = torch.randint(0, 128, (batch, length), generator=g)
    # explicit, per-row positions (a continuation past the llama3 original context of 32)
    pos = torch.arange(length).expand(batch, length) + offset + 7 * torch.arange(batch)[:, None]
    with torch.no_grad():
        want = ref(ids, position_ids=pos).logits
        got = ours(ids, pos)
        assert (got - want).abs().max().item() <= 1e-4
        if offset == 0 and batch == 1:  # default positions are 0..T-1
            assert (ours(ids) - want).abs().max().item() <= 1e-4


def test_forward_hidden_and_tying(pair):
    name, ours, _ = pair
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ours.forward_hidden(ids, None)
        assert h.shape == (2, 9, 64)
        torch.testing.assert_close(ours.lm_head(h), ours(ids))
    tied = name == "tied"
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is tied
    assert not any(p.is_meta for p in ours.parameters()) and not ours.training


def test_rope_scaling_takes_effect(tmp_path):
    cfg = llama.Config.from_hf(llama.tiny_hf_config(rope_scaling=LLAMA3_ROPE))
    plain = llama.Config.from_hf(llama.tiny_hf_config())
    assert cfg.rope.rope_type == "llama3" and plain.rope.rope_type == "default"
    assert not torch.equal(cfg.rope.inv_freq(16), plain.rope.inv_freq(16))
    # v5 `rope_parameters` and v4 `rope_theta` + `rope_scaling` normalize the same way
    v5 = RopeConfig.from_hf({"rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}})
    v4 = RopeConfig.from_hf({"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE}})
    assert v5 == v4
    yarn = llama.Config.from_hf(llama.tiny_hf_config(rope_scaling=YARN_ROPE)).rope
    assert yarn.rope_type == "yarn" and yarn.attention_scaling == pytest.approx(
        0.1 * __import__("math").log(4.0) + 1.0, rel=1e-12)
    assert not torch.equal(yarn.inv_freq(16), plain.rope.inv_freq(16))
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_config_from_hf_text_config_and_defaults():
    hf = llama.tiny_hf_config()
    hf.pop("head_dim")
    cfg = llama.Config.from_hf({"text_config": hf})
    assert cfg.head_dim == 64 // 4 and cfg.num_key_value_heads == 2
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # frozen


def test_params_to_checkpoint_round_trip(tmp_path):
    path = llama.make_tiny(tmp_path, seed=2, config_overrides={"tie_word_embeddings": True})
    reader = open_checkpoint(path)
    model = load_model(path)
    out = llama.params_to_checkpoint(model.state_dict(), model.cfg)
    assert sorted(out) == sorted(reader.keys()) and "lm_head.weight" not in out
    for k, v in out.items():
        assert torch.equal(v, reader.get(k)), k
    params = llama.checkpoint_to_params(reader, model.cfg)
    assert "lm_head.weight" not in params and len(params) == len(out)


def test_inv_freq_is_a_computed_buffer():
    cfg = llama.Config.from_hf(llama.tiny_hf_config())
    with torch.device("meta"):
        model = llama.Model(cfg)
    assert "model.rotary_emb.inv_freq" not in model.state_dict()
    model.init_buffers()
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, cfg.rope.inv_freq(16))


def test_bf16_load_runs_close_to_fp32(tmp_path):
    path = llama.make_tiny(tmp_path, seed=6)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        ref = load_model(path)(ids)
        got = load_model(path, dtype="bf16")(ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_yarn_deployment_greedy_equals_transformers(tmp_path):
    """The deployed graph (fused RoPE + attention, CPU graphs) scales YaRN's cos / sin too:
    greedy past the original context = transformers' greedy."""
    from specdeploy import LLM, SamplingParams

    path = llama.make_tiny(tmp_path, seed=1, config_overrides=VARIANTS["yarn_rope"])
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(3, 60))
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0]
    llm = LLM(str(path), max_batch_size=1, max_seq_len=200)
    got = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    assert got == want[len(prompt):].tolist()
