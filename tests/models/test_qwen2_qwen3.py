"""Qwen2 / Qwen3 through the Llama module (q/k/v biases; per-head q/k RMSNorms): logits equal
transformers' own classes; a deployment's greedy tokens with an EAGLE-3 head and with CPU graphs
equal the plain eager ones; sliding windows (Mistral's, Qwen2's from `max_window_layers` on)
equal transformers' and deploy (chunked prefill, decode past the window, CPU graphs, EAGLE-3)."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.loading import load_model
from specdeploy.models import llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return request.param, llama.make_tiny(tmp_path_factory.mktemp(request.param), seed=1,
                                          config_overrides=llama.tiny_qwen_config(request.param))


@pytest.mark.parametrize("b,t", [(1, 1), (1, 40), (2, 17)])
def test_logits_match_transformers(tiny, b, t):
    kind, path = tiny
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == f"Qwen{kind[-1]}ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model(path)
    assert hasattr(ours.model.layers[0].self_attn, "q_norm") == (kind == "qwen3")
    assert (ours.model.layers[0].self_attn.q_proj.bias is not None) == (kind == "qwen2")
    assert ours.model.layers[0].self_attn.o_proj.bias is None
    ids = torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        want = hf.eval()(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert want.abs().mean() > 0.05


def test_eagle3_and_graphs_are_lossless(tiny, tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    _, path = tiny
    head = make_tiny_eagle3(path, tmp_path / "eagle3", seed=0)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["hello there", "a b c d e f", "the the the the"]
    kw = dict(max_batch_size=4, max_seq_len=256)
    want = [o.token_ids for o in LLM(str(path), cpu_graphs=False, **kw).generate(prompts, sp)]
    graphs = LLM(str(path), **kw)
    assert [o.token_ids for o in graphs.generate(prompts, sp)] == want
    assert graphs.deployed.graph_runner.replays > 0
    spec = LLM(str(path), spec={"method": "eagle3", "draft_model": str(head),
                                "num_draft_tokens": 3, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0


WINDOWED = {  # 8-token windows: the prompts below are 3-5 windows long
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": 8},
    "qwen2": {**llama.tiny_qwen_config("qwen2"), "use_sliding_window": True,
              "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
}


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tmp_path_factory):
    kind = request.param
    path = llama.make_tiny(tmp_path_factory.mktemp(f"win_{kind}"), seed=4,
                           config_overrides=WINDOWED[kind])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return kind, path, hf


def test_sliding_windows_equal_transformers(windowed):
    """Logits over 30 tokens (windows of 8): Mistral windows every layer; Qwen2 those from
    `max_window_layers` (1) on; a deployment's greedy tokens = `generate`, past the window."""
    kind, path, hf = windowed
    ours = load_model(path)
    want_windows = (8, 8) if kind == "mistral" else (0, 8, 8)
    assert ours.cfg.windows == want_windows
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max()
    unwindowed = llama.Model(llama.Config.from_hf({**ours.hf_config, "sliding_window": None,
                                                  "use_sliding_window": False}))
    unwindowed.load_state_dict(ours.state_dict())
    with torch.no_grad():  # (the windows matter here: the same weights without them differ)
        assert (unwindowed(ids) - want).abs().max().item() > 1e-2 * want.abs().max()
    prompt = list(range(5, 29))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    kw = dict(max_batch_size=2, max_seq_len=128, max_num_tokens=8)  # chunks of one window
    got = LLM(str(path), **kw).generate([prompt], sp)[0].token_ids
    t = torch.tensor([prompt])
    hf.generation_config.eos_token_id = None
    ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=20,
                      do_sample=False)[0, len(prompt):].tolist()
    assert got == ref


def test_sliding_windows_with_eagle3_and_graphs(windowed, tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    _, path, _ = windowed
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["hello there my friend", "a b c d e f g h i j k", "the the the the"]
    kw = dict(max_batch_size=4, max_seq_len=256)
    want = [o.token_ids for o in LLM(str(path), cpu_graphs=False, **kw).generate(prompts, sp)]
    assert [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)] == want
    head = make_tiny_eagle3(path, tmp_path / "e3", seed=0)
    spec = LLM(str(path), spec={"method": "eagle3", "draft_model": str(head),
                                "num_draft_tokens": 3, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0


def test_window_configs_are_checked():
    base = llama.tiny_hf_config(**WINDOWED["mistral"])
    with pytest.raises(ValueError, match="sliding_attention layers but no sliding_window"):
        llama.Config.from_hf({**base, "sliding_window": None,
                              "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]"):
        llama.Config.from_hf({**base, "layer_types": ["chunked_attention", "full_attention"]})
    assert llama.Config.from_hf({**base, "layer_types": ["full_attention",
                                                         "sliding_attention"]}).windows == (0, 8)


def test_mistral_without_a_window_is_llama(tmp_path):
    """`MistralForCausalLM` with no sliding window deploys as Llama: logits = transformers'."""
    over = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": None}
    path = llama.make_tiny(tmp_path / "m", seed=4, config_overrides=over)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    assert load_model(path).cfg.windows == ()
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert (load_model(path)(ids) - want).abs().max().item() <= 1e-4 * want.abs().max()
