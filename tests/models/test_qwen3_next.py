"""Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3.5-MoE's blocks under 1-D RoPE, GDN projections
grouped per key head) against transformers' own class on a checkpoint transformers wrote;
our tiny checkpoint's layout is transformers'; the deployment's greedy tokens = `generate`; its
MTP layer drafts losslessly; 2 ranks = one process."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import qwen3_next

transformers = pytest.importorskip("transformers")
RTOL = 1e-4  # of the largest logit, fp32 (the gated delta rule's summation order: test_qwen3_5)
LIMITS = dict(max_batch_size=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _randomize(model: torch.nn.Module) -> None:
    """O(1) activations: transformers' init (std 0.02, zero norms) leaves near-zero logits."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=g).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred: the scale is 1 + w
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A checkpoint written by transformers' own `save_pretrained`, and that model."""
    d = tmp_path_factory.mktemp("qwen3_next_hf")
    cfg = transformers.Qwen3NextConfig(**{k: v for k, v in qwen3_next.tiny_hf_config().items()
                                          if k not in ("architectures", "model_type",
                                                       "torch_dtype", "mtp_num_hidden_layers")})
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    _randomize(model)
    model.save_pretrained(d)
    write_tiny_tokenizer(d, cfg.vocab_size)
    model.config._attn_implementation = "eager"
    return d, model


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b,t", [(1, 1), (1, 33), (2, 70)])
def test_logits_equal_transformers_on_its_own_checkpoint(hf_pair, b, t):
    from specdeploy.checkpoint import open_checkpoint

    path, hf = hf_pair
    keys = open_checkpoint(path).keys()  # transformers wrote the grouped projections
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in keys
    assert not any("in_proj_qkv." in k for k in keys)
    ours = load_model(path, dtype=torch.float32)
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()
    assert want.abs().mean() > 0.1


def test_our_tiny_checkpoint_is_transformers_layout(tmp_path):
    path = qwen3_next.make_tiny(tmp_path / "t", seed=2, mtp_layers=1)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    ids = _ids(1, 40, seed=3)
    with torch.no_grad():
        want = hf.eval()(input_ids=ids).logits
        got = load_model(path, dtype=torch.float32)(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()


def test_greedy_equals_transformers_generate(hf_pair):
    path, hf = hf_pair
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61))]
    got = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, GREEDY)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=24,
                          do_sample=False)[0, len(p):].tolist()
        assert ours == ref


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return qwen3_next.make_tiny(tmp_path_factory.mktemp("qwen3_next_mtp"), seed=4,
                                mtp_layers=1)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(mtp_dir, k):
    prompts = ["hello there", "a b c d e f", "the the the the"]
    want = [o.token_ids for o in LLM(mtp_dir, **LIMITS).generate(prompts, GREEDY)]
    spec = LLM(mtp_dir, spec={"method": "mtp", "num_speculative_tokens": k,
                              "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(mtp_dir):
    """Key / value heads of the GDN (split from the grouped projections at load) and the
    experts over 2 gloo ranks, with MTP drafting."""
    prompts = ["hello there", "a b c d e f"]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    want = [o.token_ids for o in LLM(mtp_dir, spec=spec, **LIMITS).generate(prompts, GREEDY)]
    tp = LLM(mtp_dir, spec=spec, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.shutdown()


def test_refusals_name_what(tmp_path, mtp_dir):
    hf = qwen3_next.tiny_hf_config()
    with pytest.raises(ValueError, match="mlp_only_layers"):
        qwen3_next.Config.from_hf({**hf, "mlp_only_layers": [1]})
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(mtp_dir / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.in_proj_qkvz.weight"]
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text((mtp_dir / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"Qwen3-Next .*layers\.1\.linear_attn"
                                              r"\.in_proj_qkvz\.weight"):
        load_model(out, dtype=torch.float32)


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "qwen3_next", "--mtp-layers", "1", "--out",
                 str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3NextForCausalLM"] and hf["mtp_num_hidden_layers"] == 1


def test_an_undeclared_mtp_layer_is_found_in_the_tensors(mtp_dir, tmp_path):
    """Released Qwen3-Next configs do not declare their MTP layer: the `mtp.*` tensors do, and
    `SpecConfig("mtp")` finds it (drafting losslessly) as with the declared count."""
    import shutil

    out = tmp_path / "undeclared"
    shutil.copytree(mtp_dir, out)
    hf = json.loads((out / "config.json").read_text())
    del hf["mtp_num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(hf))
    from specdeploy.checkpoint import open_checkpoint

    assert open_checkpoint(out).config["mtp_num_hidden_layers"] == 1
    from specdeploy import SpecConfig
    from specdeploy.spec_auto import resolve_auto

    assert resolve_auto(SpecConfig("auto"), out).method == "mtp"  # `auto` finds it too
    prompts = ["hello there", "a b c d e f"]
    want = [o.token_ids for o in LLM(out, **LIMITS).generate(prompts, GREEDY)]
    spec = LLM(out, spec={"method": "mtp", "num_speculative_tokens": 2}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.stats()["draft_steps"] > 0
