"""EAGLE-3 drafter: forward vs a plain-torch reference, round trip, vocab maps, errors."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdeploy.checkpoint import CheckpointError
from specdeploy.models.drafters import DraftOutput
from specdeploy.models.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    load_eagle3,
    make_tiny_eagle3,
    save_eagle3,
)
from specdeploy.ops import attention_ref, rms_norm_ref, rope_cos_sin, rope_ref

TARGET = {  # a tiny Llama target's config.json, as transformers 5 writes it
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 4, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
VD = 48


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    return make_tiny_eagle3(tmp_path / "target", tmp_path / "drafter", seed=0, draft_vocab_size=VD)


def reference(sd: dict, cfg: Eagle3Config, hidden, embeds, pos, norm_before_residual=False):
    """EAGLE-3 step written from the published code, on plain tensors and the *_ref ops."""
    def lin(x, name):
        return x @ sd[name + ".weight"].T

    def norm(x, name):
        return rms_norm_ref(x, sd[name + ".weight"], cfg.rms_norm_eps)

    if hidden.shape[-1] == 3 * cfg.target_hidden_size:
        hidden = lin(hidden, "fc")
    b, t, d = hidden.shape[0], hidden.shape[1], cfg.head_dim
    inv = 1.0 / cfg.rope.theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = rope_cos_sin(pos, inv)
    normed = norm(hidden, "midlayer.hidden_norm")
    residual = normed if norm_before_residual else hidden
    x = torch.cat([norm(embeds, "midlayer.input_layernorm"), normed], dim=-1)
    q = rope_ref(lin(x, "midlayer.self_attn.q_proj").view(b, t, -1, d), cos, sin)
    k = rope_ref(lin(x, "midlayer.self_attn.k_proj").view(b, t, -1, d), cos, sin)
    v = lin(x, "midlayer.self_attn.v_proj").view(b, t, -1, d)
    o = attention_ref(q, k, v, d**-0.5).reshape(b, t, -1)
    h = residual + lin(o, "midlayer.self_attn.o_proj")
    y = norm(h, "midlayer.post_attention_layernorm")
    gate, up = lin(y, "midlayer.mlp.gate_proj"), lin(y, "midlayer.mlp.up_proj")
    h = h + lin(F.silu(gate) * up, "midlayer.mlp.down_proj")
    return h, lin(norm(h, "norm"), "lm_head")


def _inputs(cfg: Eagle3Config, b=2, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g)
    embeds = torch.randn(b, t, cfg.hidden_size, generator=g)
    pos = torch.arange(3, 3 + t).expand(b, t)
    return hidden, embeds, pos


def test_forward_matches_reference_and_chains_prenorm_hidden(tiny):
    drafter = load_eagle3(tiny, target_cfg=TARGET, dtype=torch.float32)
    cfg, sd = drafter.cfg, drafter.state_dict()
    hidden, embeds, pos = _inputs(cfg)
    out = drafter(hidden, embeds, pos)
    assert isinstance(out, DraftOutput)
    assert out.hidden.shape == (2, 7, 64) and out.logits.shape == (2, 7, VD)
    ref_h, ref_logits = reference(sd, cfg, hidden, embeds, pos)
    torch.testing.assert_close(out.hidden, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
    # Second draft step: the own (pre-norm) hidden [B,T,H] goes in, no fc.
    out2 = drafter(out.hidden, embeds.flip(1), pos + 1)
    ref2 = reference(sd, cfg, ref_h, embeds.flip(1), pos + 1)
    torch.testing.assert_close(out2.hidden, ref2[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2.logits, ref2[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="192"):
        drafter(hidden[..., :100], embeds, pos)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_wider_target_own_embedding_and_norm_before_residual(tmp_path, norm_before_residual):
    hf = {**TARGET, "num_hidden_layers": 1, "target_hidden_size": 40, "draft_vocab_size": VD,
          "norm_before_residual": norm_before_residual}
    cfg = Eagle3Config.from_hf(hf)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)  # no shared embedding given: it owns one
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    assert drafter.fc.weight.shape == (64, 120)
    hidden, embeds, pos = _inputs(cfg)
    out = drafter(hidden, embeds, pos)
    ref = reference(drafter.state_dict(), cfg, hidden, embeds, pos, norm_before_residual)
    torch.testing.assert_close(out.hidden, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref[1], rtol=1e-5, atol=1e-5)
    save_eagle3(drafter, tmp_path / "d")
    assert "embed_tokens.weight" in load_file(tmp_path / "d" / "model.safetensors")
    loaded = load_eagle3(tmp_path / "d", target_cfg={"hidden_size": 40, "vocab_size": 128})
    assert "embed_tokens.weight" in dict(loaded.named_parameters())
    assert loaded.cfg == cfg
    ids = torch.tensor([[1, 5, 127]])
    torch.testing.assert_close(loaded.embed(ids), drafter.embed_tokens(ids))
    torch.testing.assert_close(loaded(hidden, embeds, pos).logits, out.logits)


def test_save_load_round_trip(tiny, tmp_path):
    shared = nn.Embedding(128, 64)
    a = load_eagle3(tiny, target_cfg=TARGET, embed_tokens=shared)
    assert not any(n.startswith("embed_tokens") for n in a.state_dict())
    torch.testing.assert_close(a.embed(torch.tensor([3, 9])), shared(torch.tensor([3, 9])))
    save_eagle3(a, tmp_path / "again")
    b = load_eagle3(tmp_path / "again", target_cfg=TARGET)
    assert a.cfg == b.cfg and b.cfg.aux_layer_ids == (0, 2, 3)
    assert torch.equal(a.d2t, b.d2t) and a.d2t.dtype == torch.int64 and torch.equal(a.t2d, b.t2d)
    x = _inputs(a.cfg)
    oa, ob = a(*x), b(*x)
    assert torch.equal(oa.hidden, ob.hidden) and torch.equal(oa.logits, ob.logits)
    with pytest.raises(RuntimeError, match="no embedding"):
        b.embed(torch.tensor([0]))


def test_draft_to_target_mapping(tiny):
    drafter = load_eagle3(tiny)
    in_draft = drafter.t2d.nonzero().flatten()
    assert in_draft.numel() == VD and drafter.t2d.dtype == torch.bool
    assert torch.equal(drafter.draft_to_target(torch.arange(VD)), in_draft)
    ids = torch.tensor([[0, VD - 1], [5, 5]])
    assert torch.equal(drafter.draft_to_target(ids), in_draft[ids])
    logits = torch.randn(2, VD)
    full = drafter.logits_to_target(logits)
    assert full.shape == (2, 128)
    assert torch.equal(full[:, in_draft], logits)
    assert torch.isinf(full[:, ~drafter.t2d]).all()
    assert torch.equal(full.argmax(-1), drafter.draft_to_target(logits.argmax(-1)))


def test_mismatched_target_names_both_sizes(tiny):
    with pytest.raises(CheckpointError, match=r"hidden size 64.*hidden size is 48"):
        load_eagle3(tiny, target_cfg={**TARGET, "hidden_size": 48})
    with pytest.raises(CheckpointError, match=r"vocab of 128.*vocab size is 100"):
        load_eagle3(tiny, target_cfg=SimpleNamespace(hidden_size=64, vocab_size=100))
    with pytest.raises(CheckpointError, match=r"width 32.*hidden size 64"):
        load_eagle3(tiny, embed_tokens=nn.Embedding(128, 32))


def test_missing_tensor_is_named(tiny):
    f = tiny / "model.safetensors"
    tensors = load_file(f)
    del tensors["midlayer.self_attn.k_proj.weight"], tensors["d2t"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"midlayer\.self_attn\.k_proj\.weight.*d2t"):
        load_eagle3(tiny)


def test_missing_vocab_maps_mean_identity_when_vocabs_match(tmp_path):
    cfg = Eagle3Config.from_hf({**TARGET, "num_hidden_layers": 1})
    save_eagle3(Eagle3Drafter(cfg, own_embedding=False), tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if k not in ("d2t", "t2d")}, f)
    drafter = load_eagle3(tmp_path / "d")
    assert torch.equal(drafter.draft_to_target(torch.arange(128)), torch.arange(128))
    assert bool(drafter.t2d.all())


def test_released_config_format_and_llama3_rope():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    released = {  # EAGLE3-LLaMA3.1-Instruct-8B layout, shrunk
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": scaling,
        "max_position_embeddings": 2048,
        "vocab_size": 128, "draft_vocab_size": 32, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
    }
    cfg = Eagle3Config.from_hf(released)
    assert (cfg.head_dim, cfg.target_hidden_size, cfg.aux_layer_ids) == (16, 64, (1, 15, 28))
    assert Eagle3Config.from_hf(cfg.to_hf()) == cfg
    plain = Eagle3Config.from_hf({**released, "rope_scaling": None})
    assert plain.rope.rope_type == "default" and Eagle3Config.from_hf(plain.to_hf()) == plain
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=16384,
                     rope_parameters={**scaling, "rope_theta": 500000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(Eagle3Drafter(cfg).rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    with pytest.raises(CheckpointError, match="2 layers"):
        Eagle3Config.from_hf({**released, "num_hidden_layers": 2})
    # a gpt-oss EAGLE-3 head's YaRN (as its target's): round trip, and transformers' tables
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": False}
    ycfg = Eagle3Config.from_hf({**released, "rope_theta": 150000.0, "rope_scaling": yarn,
                                 "max_position_embeddings": 131072})
    assert ycfg.rope.rope_type == "yarn" and Eagle3Config.from_hf(ycfg.to_hf()) == ycfg
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072,
                     rope_parameters={**yarn, "rope_theta": 150000.0})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(Eagle3Drafter(ycfg).rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    assert ycfg.rope.attention_scaling == pytest.approx(factor, rel=1e-12)
    with pytest.raises(ValueError, match="dynamic"):
        Eagle3Config.from_hf({**released, "rope_scaling": {"rope_type": "dynamic"}})


def test_export_keeps_canonical_ops(tiny):
    drafter = load_eagle3(tiny)
    ep = torch.export.export(drafter, _inputs(drafter.cfg, b=1, t=4))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for op in ("specdeploy.attention", "specdeploy.rope", "specdeploy.rms_norm"):
        assert any(op in t for t in targets), op


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_format_loads_as_the_common_one(tiny, tmp_path, nbr):
    """The `speculators` library's layout (Red Hat's `*-speculator.eagle3` heads:
    `Eagle3Speculator`, the layer's config in `transformer_layer_config`, the layer as
    `layers.0.*`) and vLLM's `Eagle3LlamaForCausalLM` name give the drafter of the common
    format: same config, same outputs."""
    common = json.loads((tiny / "config.json").read_text())
    common["norm_before_residual"] = nbr
    (tiny / "config.json").write_text(json.dumps(common))
    want = load_eagle3(tiny, target_cfg=TARGET, embed_tokens=nn.Embedding(128, 64))
    layer = {k: v for k, v in common.items()
             if k not in ("architectures", "draft_vocab_size", "target_hidden_size",
                          "norm_before_residual", "eagle_config")}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": VD,
            "norm_before_residual": nbr, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": common["eagle_config"][
                "eagle_aux_hidden_state_layer_ids"],
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "target"}}}
    out = tmp_path / "speculators"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(spec))
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in load_file(tiny / "model.safetensors").items()}
    save_file(tensors, str(out / "model.safetensors"))
    got = load_eagle3(out, target_cfg=TARGET, embed_tokens=want.borrowed["embed_tokens"])
    assert got.cfg == want.cfg
    x = _inputs(want.cfg)
    assert torch.equal(got(*x).logits, want(*x).logits)
    alias = tmp_path / "alias"
    alias.mkdir()
    (alias / "config.json").write_text(json.dumps({**common,
                                                  "architectures": ["Eagle3LlamaForCausalLM"]}))
    save_file(load_file(tiny / "model.safetensors"), str(alias / "model.safetensors"))
    assert load_eagle3(alias, target_cfg=TARGET).cfg == want.cfg
    (out / "config.json").write_text(json.dumps({**spec, "speculators_model_type": "eagle"}))
    with pytest.raises(CheckpointError, match="speculators drafter of type 'eagle'"):
        load_eagle3(out, target_cfg=TARGET)
