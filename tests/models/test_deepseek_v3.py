"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) and V2 (`DeepseekV2ForCausalLM`): logits = transformers'
classes (q latent or plain q_proj, plain RoPE or YaRN with mscale, V2's greedy or group-limited
softmax routing), on our tiny checkpoints and on one transformers wrote; absorbed MLA = the
expanded form per layer, and a mix-up of W_UK / W_UV is seen; the deployed cache holds the
latent key only; greedy = `generate`; the MTP draft step = the same step built from
transformers' own decoder layer (transformers runs no MTP); MTP and n-gram drafting lossless;
2 ranks = one process; refusals name what they refuse."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import deepseek_v3 as ds
from specdeploy.ops import attention_ref

transformers = pytest.importorskip("transformers")
RTOL = 1e-4  # of the largest logit, fp32
LIMITS = dict(max_batch_size=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = ["hello there", "a b c d e f", "the the the the"]
VARIANTS = {"q_lora": {}, "q_proj": {"q_lora_rank": None}, "yarn": {"yarn": True},
            # DeepSeek-V2-Lite's shape (no q latent, YaRN) and V2's group-limited routing
            "v2_greedy": {"v2": "greedy", "q_lora_rank": None, "yarn": True},
            "v2_group": {"v2": "group_limited_greedy", "yarn": True}}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tinies(tmp_path_factory):
    """Each variant's checkpoint (with one MTP layer) and transformers' model of it."""
    out = {}
    for name, kw in VARIANTS.items():
        path = ds.make_tiny(tmp_path_factory.mktemp(f"ds_{name}"), seed=3,
                            hf_config=ds.tiny_hf_config(mtp_layers=1, **kw))
        out[name] = (path, _hf(path))
    return out


@pytest.fixture(scope="module")
def plain_llm(tinies):
    """The q_lora variant deployed without drafting (one deployment for the module)."""
    return LLM(tinies["q_lora"][0], **LIMITS)


@pytest.fixture(scope="module")
def plain_outputs(plain_llm):
    """Its greedy outputs."""
    return plain_llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def plain(plain_outputs):
    return [o.token_ids for o in plain_outputs]


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max() <= RTOL * want.abs().max()
    assert want.abs().mean() > 0.1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(tinies, variant):
    path, hf = tinies[variant]
    ours = load_model(path, dtype=torch.float32)
    for b, t in [(1, 1), (2, 150)]:  # (150: past YaRN's original 128 positions)
        ids = _ids(b, t, seed=t)
        with torch.no_grad():
            _close(ours(ids), hf(input_ids=ids).logits)


def test_interleaved_rope_matters(tinies):
    """The same weights read with rope_interleave off give other logits: the test above checks
    the pair layout, not something RoPE-blind."""
    path, hf = tinies["q_lora"]
    model = load_model(path, dtype=torch.float32)
    off = replace(model.cfg, rope_interleave=False)
    for layer in model.model.layers:
        layer.self_attn.cfg = off
    ids = _ids(1, 40, seed=5)
    with torch.no_grad():
        got, want = model(ids), hf(input_ids=ids).logits
    assert (got - want).abs().max() > 100 * RTOL * want.abs().max()


def _expanded(attn: ds.Attention, x, cos, sin):
    """transformers' expanded MLA on the module's weights: kv_b_proj gives each head's k_nope
    and v, H heads of K and V attend."""
    c, (b, t, _) = attn.cfg, x.shape
    n, nope, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if c.q_lora_rank else attn.q_proj(x)
    q_nope, q_rope = q.view(b, t, n, -1).split([nope, r], -1)
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, r], -1)
    k_nope, v = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b, t, n, -1).split(
        [nope, c.v_head_dim], -1)
    q_rope = torch.ops.specdeploy.rope(attn._pairs(q_rope), cos, sin)
    k_rope = torch.ops.specdeploy.rope(attn._pairs(k_rope.view(b, t, 1, r)), cos, sin)
    o = attention_ref(torch.cat((q_nope, q_rope), -1),
                      torch.cat((k_nope, k_rope.expand(b, t, n, r)), -1), v, c.softmax_scale)
    return attn.o_proj(o.reshape(b, t, -1))


_MIXUPS = {"absorbed": lambda uk, uv: (uk, uv), "uk_uv_swapped": lambda uk, uv: (uv, uk),
           "uk_heads_reversed": lambda uk, uv: (uk.flip(0), uv),
           "uv_head_dims_reversed": lambda uk, uv: (uk, uv.flip(1))}


@pytest.mark.parametrize("mixup", list(_MIXUPS))
def test_absorbed_equals_expanded(tinies, monkeypatch, mixup):
    """Every attention layer (the MTP layer's too), YaRN, 2 x 150 random tokens: the absorbed
    forward = the expanded one within 1e-5 of its largest value; W_UK and W_UV swapped (the
    tiny's qk_nope = v_head_dim lets them), or their heads / rows permuted, is far off."""
    path, _ = tinies["yarn"]
    model = load_model(path, dtype=torch.float32, with_mtp=True)
    real = ds.Attention.absorbed
    monkeypatch.setattr(ds.Attention, "absorbed",
                        lambda self: _MIXUPS[mixup](*real(self)))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 150, model.cfg.hidden_size, generator=g)
    cos, sin = model.model.rotary_emb(torch.arange(150)[None].expand(2, -1))
    layers = [*model.model.layers, *model.mtp.layers]
    assert len(layers) == 5
    for layer in layers:
        with torch.no_grad():
            got, want = layer.self_attn(x, cos, sin), _expanded(layer.self_attn, x, cos, sin)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5 if mixup == "absorbed" else err > 1e-2, err


def test_cache_holds_the_latent_key_only(plain_llm, tinies):
    """Bytes per token per layer of the deployed paged cache = (kv_lora_rank +
    qk_rope_head_dim) x the element size, from config.json: the value is the key's leading
    kv_lora_rank dims, one buffer (the expanded form held H (qk_nope + qk_rope + v))."""
    hf = json.loads((tinies["q_lora"][0] / "config.json").read_text())
    target = plain_llm.deployed
    plan, kv = target.plan, [h for h in target.resources if hasattr(h, "num_kv_heads")]
    assert len(kv) == hf["num_hidden_layers"]
    bufs = dict(target.gm.named_buffers())
    for h in kv:
        k, v = bufs[f"{h.name}_k"], bufs[f"{h.name}_v"]
        width = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
        tokens = (plan.num_pages + 1) * plan.page_size
        assert plan.bytes_by_handler[h.name] == tokens * width * k.element_size()
        assert k.nbytes == tokens * width * k.element_size()
        assert v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        assert v.shape[-1] == hf["kv_lora_rank"] and v.stride() == k.stride()


def test_a_checkpoint_transformers_wrote(tmp_path):
    """Random weights through transformers' own `save_pretrained` (its layout, its key names)."""
    hf_cfg = ds.tiny_hf_config(yarn=True)
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in hf_cfg.items() if k not in (
        "architectures", "model_type", "torch_dtype", "topk_method", "scoring_func",
        "moe_layer_freq")})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
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
        _close(load_model(tmp_path, dtype=torch.float32)(ids), model(input_ids=ids).logits)


@pytest.mark.parametrize("variant", ["q_lora", "v2_group"])  # (v2_group: YaRN deployed too)
def test_greedy_equals_transformers_generate(tinies, plain_outputs, variant):
    path, hf = tinies[variant]
    outs = plain_outputs if variant == "q_lora" else LLM(path, **LIMITS).generate(PROMPTS, GREEDY)
    hf.generation_config.eos_token_id = None
    for o in outs:
        t = torch.tensor([o.prompt_token_ids])
        ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=24,
                          do_sample=False)[0, t.shape[1]:].tolist()
        assert o.token_ids == ref


def test_group_limited_routing_matters(tinies):
    """V2's group-limited checkpoint read as greedy gives other logits: the logits test above
    sees the group limit."""
    path, hf = tinies["v2_group"]
    model = load_model(path, dtype=torch.float32)
    greedy = replace(model.cfg, topk_method="greedy")
    for layer in model.model.layers[1:]:
        layer.mlp.cfg = greedy
    ids = _ids(1, 40, seed=5)
    with torch.no_grad():
        got, want = model(ids), hf(input_ids=ids).logits
    assert (got - want).abs().max() > 100 * RTOL * want.abs().max()


def test_mtp_step_equals_transformers_blocks(tinies):
    """The draft step (embedding zeroed at position 0, eh_proj over [enorm(e), hnorm(h)], the
    decoder layer, shared_head.norm, the LM head) rebuilt from transformers' DeepSeek-V3
    decoder layer, RMSNorm and rotary embedding with the checkpoint's `model.layers.4.*`."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    path, hf = tinies["yarn"]
    reader, cfg = open_checkpoint(path), hf.config
    n = cfg.num_hidden_layers
    layer = m.DeepseekV3DecoderLayer(cfg, n).eval()  # (an MoE layer, as the trailing ones)
    own = {k[len(f"model.layers.{n}."):]: reader.get(k) for k in reader.keys()
           if k.startswith(f"model.layers.{n}.")}
    e = cfg.n_routed_experts  # the stored per-expert keys as transformers' fused parameters
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [own.pop(f"mlp.experts.{i}.gate_proj.weight"), own.pop(f"mlp.experts.{i}.up_proj.weight")])
        for i in range(e)])
    own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{i}.down_proj.weight")
                                                for i in range(e)])
    extra = ("enorm", "hnorm", "eh_proj", "shared_head")
    missing, _ = layer.load_state_dict({k: v for k, v in own.items()
                                        if not k.startswith(extra)}, strict=False)
    assert not missing
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = m.DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(own[f"{name}.weight"])
    g, t = torch.Generator().manual_seed(1), 9
    hidden, ids = torch.randn(1, t, cfg.hidden_size, generator=g), _ids(1, t, seed=2)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        emb = hf.model.embed_tokens(ids)
        e0 = emb.masked_fill((pos == 0)[..., None], 0.0)
        x = torch.cat((norms["enorm"](e0), norms["hnorm"](hidden)), -1) @ own["eh_proj.weight"].T
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_embeddings=hf.model.rotary_emb(hidden, pos))
        want = hf.lm_head(norms["shared_head.norm"](x))
        out = load_model(path, dtype=torch.float32, with_mtp=True).mtp(hidden, emb, pos)
    torch.testing.assert_close(out.hidden, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 1},
                                  {"method": "mtp", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["mtp1", "mtp3", "ngram3"])
def test_speculative_greedy_equals_plain(tinies, plain, spec):
    path, _ = tinies["q_lora"]
    llm = LLM(path, spec={**spec, "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert llm.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(tinies, plain):
    """Heads (q_b / kv_b / o), the dense and shared MLPs and the experts split over 2 ranks;
    with MTP drafting, as the one-process plain run."""
    path, _ = tinies["q_lora"]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tp = LLM(path, spec=spec, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(PROMPTS, GREEDY)] == plain
    finally:
        tp.shutdown()


@pytest.mark.parametrize("change,match", [
    ({"scoring_func": "softmax"}, r"scoring_func 'softmax' is not supported"),
    ({"topk_method": "group_limited_greedy"}, r"topk_method 'group_limited_greedy'"),
    ({"moe_layer_freq": 2}, r"moe_layer_freq=2"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic'"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"v2": "greedy", "scoring_func": "sigmoid"}, r"deepseek_v2: scoring_func 'sigmoid'"),
    ({"v2": "greedy", "topk_method": "noaux_tc"}, r"deepseek_v2: topk_method 'noaux_tc'"),
    ({"v2": "greedy", "norm_topk_prob": True}, r"deepseek_v2: norm_topk_prob=true"),
])
def test_refusals_name_what(change, match):
    hf = ds.tiny_hf_config(v2=change.pop("v2", None))
    with pytest.raises(ValueError, match=match):
        ds.Config.from_hf({**hf, **change})


def test_missing_mtp_layer_is_named(tinies, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tinies["q_lora"]
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
               if not k.startswith("model.layers.4.")}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"DeepSeek-V3 MTP layer tensors are missing .*"
                                              r"num_nextn_predict_layers=1.*model\.layers\.4\."):
        load_model(tmp_path, dtype=torch.float32, with_mtp=True)
    load_model(tmp_path, dtype=torch.float32)  # the target alone loads


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "deepseek_v3", "--mtp-layers", "1", "--out",
                 str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["num_nextn_predict_layers"] == 1
