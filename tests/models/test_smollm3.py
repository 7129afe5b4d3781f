"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama module with RoPE off on every 4th layer (NoPE).
Oracle: transformers' class in fp32 (logits within 1e-4 of the largest; greedy = `generate`);
a guard that the NoPE layers matter; n-gram speculation lossless."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.loading import load_model
from specdeploy.models import llama

transformers = pytest.importorskip("transformers")
SMOLLM3 = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
           "num_hidden_layers": 4, "tie_word_embeddings": True, "use_sliding_window": False,
           "no_rope_layer_interval": 4, "rope_theta": 5e6}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = llama.make_tiny(tmp_path_factory.mktemp("smollm3") / "m", seed=4,
                           config_overrides=SMOLLM3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, hf


def test_config_reads_the_nope_layers():
    cfg = llama.Config.from_hf(llama.tiny_hf_config(**SMOLLM3))
    assert [cfg.rope_at(i) for i in range(4)] == [True, True, True, False]
    explicit = llama.Config.from_hf(llama.tiny_hf_config(**SMOLLM3, no_rope_layers=[0, 1, 1, 1]))
    assert [explicit.rope_at(i) for i in range(4)] == [False, True, True, True]
    with pytest.raises(ValueError, match="no_rope_layers has 2 entries for 4 layers"):
        llama.Config.from_hf(llama.tiny_hf_config(**SMOLLM3, no_rope_layers=[1, 1]))


def test_logits_equal_transformers_and_nope_matters(tiny):
    path, hf = tiny
    ours = load_model(path, dtype=torch.float32)
    assert not ours.model.layers[3].self_attn.rope and ours.model.layers[2].self_attn.rope
    ids = torch.randint(0, 124, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        err = ((ours(ids) - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-4, err
        ours.model.layers[3].self_attn.rope = True  # the guard: RoPE there moves the logits
        assert ((ours(ids) - want).abs().max() / want.abs().max()).item() > 1e-2


def test_greedy_equals_generate_and_ngram_is_lossless(tiny):
    path, hf = tiny
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    kw = dict(max_batch_size=2, max_seq_len=128)
    got = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                                "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == got
    assert spec.stats()["draft_steps"] > 0


def test_gguf_smollm3_equals_the_checkpoint(tiny, tmp_path):
    """A "smollm3" GGUF in llama.cpp's converter layout (llama's names, q/k rows permuted):
    every parameter bit for bit, the same greedy tokens."""
    gguf = pytest.importorskip("gguf")
    import json

    from specdeploy.checkpoint import open_checkpoint
    from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer
    from tests.checkpoint.test_gguf import _permute

    path, _ = tiny
    c = json.loads((path / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.SMOLLM3, c["num_hidden_layers"])
    out = tmp_path / "smollm3.gguf"
    w = gguf.GGUFWriter(str(out), "smollm3")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    add_tokenizer(w, path, c["vocab_size"])
    reader = open_checkpoint(path)
    for key in reader.keys():
        a = reader.get(key).float().numpy()
        if key.endswith("q_proj.weight"):
            a = _permute(a, c["num_attention_heads"])
        elif key.endswith("k_proj.weight"):
            a = _permute(a, c["num_key_value_heads"])
        w.add_tensor(names.get_name(key, try_suffixes=(".weight",)), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a = load_model(out, dtype=torch.float32).state_dict()
    b = load_model(path, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(path), **kw).generate([list(range(30, 50))], sp)]
    assert [o.token_ids for o in LLM(str(out), **kw).generate([list(range(30, 50))], sp)] == want
