"""IBM Granite 4.0 (`GraniteMoeHybridForCausalLM`): the hybrid (Mamba2 + NoPE attention + MoE
with a shared MLP, Granite's multipliers) and the dense all-attention RoPE variant against
transformers' own class, on our tiny checkpoints and on one transformers wrote; greedy =
`generate`; speculation (recurrent-state rollback) lossless; 2 ranks = one process."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import granite_hybrid as granite

transformers = pytest.importorskip("transformers")
RTOL = 1e-4  # of the largest logit, fp32
LIMITS = dict(max_batch_size=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def tiny(request, tmp_path_factory):
    dense = request.param == "dense"
    path = granite.make_tiny(tmp_path_factory.mktemp(f"granite_{request.param}"), seed=1,
                             hf_config=granite.tiny_hf_config(dense=dense))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return request.param, path, hf.eval()


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b,t", [(1, 1), (1, 37), (2, 70)])  # (SSD chunks of 16)
def test_logits_equal_transformers(tiny, b, t):
    kind, path, hf = tiny
    ours = load_model(path, dtype=torch.float32)
    assert ours.cfg.block_types == (("attention",) * 4 if kind == "dense"
                                    else ("mamba", "attention", "mamba", "mamba"))
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()
    assert want.abs().mean() > 0.1


def test_a_checkpoint_transformers_wrote(tmp_path):
    """Random weights through transformers' own `save_pretrained` (its key names: the
    released `block_sparse_moe.{router.layer, input_linear, output_linear}`)."""
    hf = {k: v for k, v in granite.tiny_hf_config().items()
          if k not in ("architectures", "model_type", "torch_dtype")}
    hf["layer_types"] = ["linear_attention" if t == "mamba" else "full_attention"
                         for t in hf["layer_types"]]
    cfg = transformers.GraniteMoeHybridConfig(**hf)
    model = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=g))
            elif name.endswith(("dt_bias", ".D", "norm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, cfg.vocab_size)
    keys = json.loads((tmp_path / "config.json").read_text())
    assert keys["architectures"] == ["GraniteMoeHybridForCausalLM"]
    ids = _ids(2, 30, seed=4)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = load_model(tmp_path, dtype=torch.float32)(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()


def test_greedy_equals_transformers_generate(tiny):
    _, path, hf = tiny
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61))]
    got = [o.token_ids for o in LLM(path, max_num_tokens=16, **LIMITS).generate(prompts,
                                                                                GREEDY)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=24,
                          do_sample=False)[0, len(p):].tolist()
        assert ours == ref


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculative_greedy_equals_plain(tiny, method, tmp_path):
    """Drafts verified and rejected: the Mamba2 states roll back to the last accepted token."""
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    kind, path, _ = tiny
    prompts = ["hello there", "a b c d e f", "the the the the"]
    want = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, GREEDY)]
    spec = {"method": method, "num_speculative_tokens": 3, "controller": "off"}
    if method == "eagle3":
        spec["model"] = str(make_tiny_eagle3(path, tmp_path / "e3"))
    else:
        spec["prompt_lookup_max"] = 2
    llm = LLM(path, spec=spec, **LIMITS)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(tiny):
    kind, path, _ = tiny
    if kind == "dense":
        pytest.skip("the hybrid covers the sharded kinds (Mamba heads, experts, attention)")
    prompts = ["hello there", "a b c d e f"]
    want = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, GREEDY)]
    tp = LLM(path, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.shutdown()


def test_config_refusals():
    hf = granite.tiny_hf_config()
    with pytest.raises(ValueError, match=r"layer types \['conv'\]"):
        granite.Config.from_hf({**hf, "layer_types": ["conv"] * 4})
    with pytest.raises(ValueError, match="position_embedding_type 'alibi'"):
        granite.Config.from_hf({**hf, "position_embedding_type": "alibi"})
    with pytest.raises(ValueError, match="no MTP head"):
        granite.Model(granite.Config.from_hf(hf), with_mtp=True)


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "granite_hybrid", "--out", str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["GraniteMoeHybridForCausalLM"]
