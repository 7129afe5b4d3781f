"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen2's attention with q/k/v biases, routed experts beside a
sigmoid-gated shared expert, top-k weights not renormalized) through the Qwen3-MoE module:
logits = transformers' class on our tiny checkpoint and on one its `save_pretrained` wrote;
greedy = `generate`; n-gram drafting lossless."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import qwen3_moe

transformers = pytest.importorskip("transformers")
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
             "shared_expert_intermediate_size": 48, "qkv_bias": True, "norm_topk_prob": False,
             "use_sliding_window": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = qwen3_moe.make_tiny(tmp_path_factory.mktemp("qwen2_moe"), seed=6,
                               config_overrides=QWEN2_MOE)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    assert not any(info.values()), info
    return path, hf.eval()


@pytest.mark.parametrize("b,t", [(1, 1), (2, 37)])
def test_logits_equal_transformers(tiny, b, t):
    path, hf = tiny
    ours = load_model(path, dtype=torch.float32)
    layer = ours.model.layers[0]
    assert layer.self_attn.q_proj.bias is not None and not hasattr(layer.self_attn, "q_norm")
    assert hasattr(layer.mlp, "shared_expert") and not layer.mlp.renormalize
    ids = torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert want.abs().mean() > 0.1


def test_a_checkpoint_transformers_wrote(tiny, tmp_path):
    _, hf = tiny
    hf.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, hf.config.vocab_size)
    ids = torch.randint(0, 124, (2, 25), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert (load_model(tmp_path, dtype=torch.float32)(ids) - want).abs().max() <= \
            1e-4 * want.abs().max()


def test_greedy_equals_generate_and_ngram_is_lossless(tiny):
    path, hf = tiny
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
    kw = dict(max_batch_size=2, max_seq_len=128)
    got = LLM(path, **kw).generate([prompt], sp)[0].token_ids
    t = torch.tensor([prompt])
    hf.generation_config.eos_token_id = None
    assert got == hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=20,
                              do_sample=False)[0, len(prompt):].tolist()
    spec = LLM(path, spec={"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 2, "controller": "off"}, **kw)
    assert spec.generate([prompt], sp)[0].token_ids == got


def test_missing_tensors_are_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    from specdeploy.checkpoint import CheckpointError

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.shared_expert_gate.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"Qwen2-MoE tensors are missing: "
                                              r"model\.layers\.0\.mlp\.shared_expert_gate"):
        load_model(tmp_path, dtype=torch.float32)
