"""GLM-4.5 (`Glm4MoeForCausalLM`): logits = transformers' class, on our tiny checkpoint and on one
transformers wrote; greedy = `generate`; the MTP layer's draft step = the same step built from
transformers' own GLM decoder layer and norms (transformers has no MTP); MTP / EAGLE-3 drafting
lossless; 2 ranks = one process."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import glm4_moe

transformers = pytest.importorskip("transformers")
RTOL = 1e-4  # of the largest logit, fp32
LIMITS = dict(max_batch_size=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = glm4_moe.make_tiny(tmp_path_factory.mktemp("glm4_moe"), seed=3, mtp_layers=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, hf


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b,t", [(1, 1), (1, 37), (2, 70)])
def test_logits_equal_transformers(tiny, b, t):
    path, hf = tiny
    ours = load_model(path, dtype=torch.float32)
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()
    assert want.abs().mean() > 0.1


def test_a_checkpoint_transformers_wrote(tmp_path):
    """Random weights through transformers' own `save_pretrained` (its layout, its key names)."""
    cfg = transformers.Glm4MoeConfig(**{k: v for k, v in glm4_moe.tiny_hf_config().items()
                                        if k not in ("architectures", "model_type",
                                                     "torch_dtype")})
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name or name.endswith("bias") else p.shape[-1] ** -0.5
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, cfg.vocab_size)
    ids = _ids(2, 30, seed=4)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = load_model(tmp_path, dtype=torch.float32)(ids)
    assert (got - want).abs().max() <= RTOL * want.abs().max()


def test_greedy_equals_transformers_generate(tiny):
    path, hf = tiny
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61))]
    got = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, GREEDY)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=24,
                          do_sample=False)[0, len(p):].tolist()
        assert ours == ref


def test_mtp_step_equals_transformers_blocks(tiny):
    """The draft step (vLLM's: embedding zeroed at position 0, eh_proj over [enorm(e), hnorm(h)],
    the decoder layer, shared_head.norm, the LM head) rebuilt from transformers' GLM decoder
    layer, RMSNorm and rotary embedding with the checkpoint's `model.layers.3.*` tensors."""
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    path, hf = tiny
    reader = open_checkpoint(path)
    cfg = hf.config
    n = cfg.num_hidden_layers
    layer = m.Glm4MoeDecoderLayer(cfg, n).eval()  # (an MoE layer: n >= first_k_dense_replace)
    own = {k[len(f"model.layers.{n}."):]: reader.get(k) for k in reader.keys()
           if k.startswith(f"model.layers.{n}.")}
    e = cfg.n_routed_experts  # the stored per-expert keys as transformers' fused parameters
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [own.pop(f"mlp.experts.{i}.gate_proj.weight"), own.pop(f"mlp.experts.{i}.up_proj.weight")])
        for i in range(e)])
    own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{i}.down_proj.weight")
                                                for i in range(e)])
    missing, _ = layer.load_state_dict({k: v for k, v in own.items()
                                        if not k.startswith(("enorm", "hnorm", "eh_proj",
                                                             "shared_head"))}, strict=False)
    assert not missing
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = m.Glm4MoeRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(own[f"{name}.weight"])
    rotary = m.Glm4MoeRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(1)
    t = 9
    hidden, ids = torch.randn(1, t, cfg.hidden_size, generator=g), _ids(1, t, seed=2)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        e = hf.model.embed_tokens(ids)
        e[pos == 0] = 0
        x = own["eh_proj.weight"] @ torch.cat((norms["enorm"](e), norms["hnorm"](hidden)),
                                              -1)[..., None]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer(x[..., 0], attention_mask=causal, position_embeddings=rotary(hidden, pos))
        want = hf.lm_head(norms["shared_head.norm"](x))
        mtp = load_model(path, dtype=torch.float32, with_mtp=True).mtp
        out = mtp(hidden, e.new_tensor(hf.model.embed_tokens(ids)), pos)
    torch.testing.assert_close(out.hidden, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_speculative_greedy_equals_plain(tiny, method, tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    path, _ = tiny
    prompts = ["hello there", "a b c d e f", "the the the the"]
    want = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, GREEDY)]
    spec = {"method": method, "num_speculative_tokens": 3, "controller": "off"}
    if method == "eagle3":
        spec["model"] = str(make_tiny_eagle3(path, tmp_path / "e3"))
    llm = LLM(path, spec=spec, **LIMITS)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(tiny):
    path, _ = tiny
    prompts = ["hello there", "a b c d e f"]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    want = [o.token_ids for o in LLM(path, spec=spec, **LIMITS).generate(prompts, GREEDY)]
    tp = LLM(path, spec=spec, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.shutdown()


def test_missing_mtp_layer_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
               if not k.startswith("model.layers.3.")}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"MTP layer tensors are missing .*"
                                              r"num_nextn_predict_layers=1.*model\.layers\.3\."):
        load_model(tmp_path, dtype=torch.float32, with_mtp=True)
    load_model(tmp_path, dtype=torch.float32)  # the target alone loads


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "glm4_moe", "--mtp-layers", "1", "--out",
                 str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Glm4MoeForCausalLM"] and hf["num_nextn_predict_layers"] == 1
