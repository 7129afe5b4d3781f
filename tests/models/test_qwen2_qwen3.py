"""Qwen2 / Qwen3 through the Llama module (q/k/v biases; per-head q/k RMSNorms): logits equal
transformers' own classes; a deployment's greedy tokens with an EAGLE-3 head and with CPU graphs
equal the plain eager ones; sliding-window configs are refused by name."""
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


def test_sliding_window_is_refused():
    for kind in ("qwen2", "qwen3"):
        hf = llama.tiny_hf_config(**{**llama.tiny_qwen_config(kind), "use_sliding_window": True})
        with pytest.raises(ValueError, match=f"{kind}: sliding-window attention"):
            llama.Config.from_hf(hf)


def test_mistral_without_a_window_is_llama(tmp_path):
    """`MistralForCausalLM` with no sliding window (or one as long as the context) deploys as
    Llama: logits = transformers' class; a shorter window is refused by name."""
    over = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": None}
    path = llama.make_tiny(tmp_path / "m", seed=4, config_overrides=over)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert (load_model(path)(ids) - want).abs().max().item() <= 1e-4 * want.abs().max()
    with pytest.raises(ValueError, match="mistral: sliding-window attention .256 tokens"):
        llama.Config.from_hf(llama.tiny_hf_config(**{**over, "sliding_window": 256}))
