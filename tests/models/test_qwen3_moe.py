"""Qwen3-MoE (`Qwen3MoeForCausalLM`): logits equal transformers' own class (per-expert and fused
expert layouts, a dense `mlp_only_layers` layer); CPU graphs and an EAGLE-3 head give the eager
greedy tokens; 2 ranks with expert parallelism give the one-process tokens."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import qwen3_moe

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return qwen3_moe.make_tiny(tmp_path_factory.mktemp("q3moe"), seed=1)


@pytest.fixture(scope="module")
def hf(tiny):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("b,t", [(1, 1), (1, 40), (2, 17)])
def test_logits_match_transformers(tiny, hf, b, t):
    ours = load_model(tiny)
    assert [type(x.mlp).__name__ for x in ours.model.layers] == ["SparseMoeBlock", "MLP",
                                                                  "SparseMoeBlock"]
    ids = torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert want.abs().mean() > 0.1


def test_fused_expert_layout_loads_the_same(tiny, tmp_path):
    """transformers' in-memory layout (fused 3-D experts) and the released per-expert keys."""
    ours = load_model(tiny)
    fused = write_checkpoint(tmp_path / "fused", qwen3_moe.tiny_hf_config(),
                             {k: v for k, v in ours.state_dict().items()
                              if not k.endswith("inv_freq")})
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(fused)(ids), ours(ids))
    with pytest.raises(CheckpointError, match="Qwen3-MoE tensors are missing: .*experts"):
        bad = {k: v for k, v in ours.state_dict().items()
               if not k.endswith(("inv_freq", "layers.2.mlp.experts.down_proj"))}
        load_model(write_checkpoint(tmp_path / "bad", qwen3_moe.tiny_hf_config(), bad))


def test_graphs_eagle3_and_ranks_are_lossless(tiny, tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    head = make_tiny_eagle3(tiny, tmp_path / "eagle3", seed=0)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = ["hello there", "a b c d e f", "the the the the"]
    kw = dict(max_batch_size=4, max_seq_len=256)
    want = [o.token_ids for o in LLM(str(tiny), cpu_graphs=False, **kw).generate(prompts, sp)]
    graphs = LLM(str(tiny), **kw)
    assert [o.token_ids for o in graphs.generate(prompts, sp)] == want
    assert graphs.deployed.graph_runner.replays > 0
    spec = LLM(str(tiny), spec={"method": "eagle3", "draft_model": str(head),
                                "num_draft_tokens": 3, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    # 2 ranks, experts split between them (attention and the dense layer's MLP by heads / width)
    llm = LLM(str(tiny), tensor_parallel_size=2, expert_parallel_size=2, dist_timeout=30, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    finally:
        llm.shutdown()
