"""Qwen3.5-MoE: logits equal transformers' own classes; both expert layouts; the MTP head."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import qwen3_5_moe as q35
from specdeploy.ops import attention_ref, moe_experts_ref, rms_norm_ref, rope_ref

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _torch_only_oracle():
    # With fla / causal_conv1d installed, or hub kernels on, transformers would swap its
    # pure-torch GDN and conv for them; the oracle must be the reference math (and these kernels
    # need CUDA). `kernels` itself comes with transformers 5.25+: tests/conftest.py turns hub
    # kernels off (USE_HUB_KERNELS=0).
    for pkg in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} installed: oracle not pure torch"
    if importlib.util.find_spec("kernels"):
        from transformers.integrations import hub_kernels

        assert not hub_kernels._kernels_enabled(), "hub kernels on: oracle not pure torch"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return q35.make_tiny(tmp_path_factory.mktemp("q35_vlm"), seed=0, mtp_layers=1)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory, vlm_dir):
    """transformers' text-only layout (`model.*`) with fused 3-D expert tensors."""
    hf = json.loads((vlm_dir / "config.json").read_text())
    config = {**hf["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"]}
    model = load_model(vlm_dir, dtype=torch.float32, with_mtp=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if "norm" in name.split(".")[-2] and not name.endswith("linear_attn.norm.weight"):
            t = t - 1.0  # back to the stored zero-centred form
        tensors[name] = t
    return write_checkpoint(tmp_path_factory.mktemp("q35_text"), config, tensors)


@pytest.fixture(scope="module")
def ours(vlm_dir):
    return load_model(vlm_dir, dtype=torch.float32, with_mtp=True)


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


CASES = [(1, 1), (1, 7), (1, 33), (1, 100), (2, 33)]


def test_config_from_vlm_and_text_configs(vlm_dir):
    hf = json.loads((vlm_dir / "config.json").read_text())
    cfg = q35.Config.from_hf(hf)
    assert cfg == q35.Config.from_hf(hf["text_config"])
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.rotary_dim, cfg.mrope_section, cfg.mrope_interleaved) == (8, (2, 1, 1), True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mtp_num_hidden_layers) == (8, 2, 1)
    # Older configs: rope_scaling + top-level rope_theta / partial_rotary_factor.
    text = {k: v for k, v in hf["text_config"].items() if k != "rope_parameters"}
    old = {**text, "rope_theta": 1e6, "partial_rotary_factor": 0.25,
           "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True}}
    assert q35.Config.from_hf(old) == cfg


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    model, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("b,t", CASES)
def test_logits_match_transformers_vlm(ours, hf_vlm, b, t):
    ids = _ids(b, t, seed=t + b)
    with torch.no_grad():
        want = hf_vlm(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= TOL


def test_text_only_fused_layout_matches_causal_lm(ours, text_dir):
    stored = load_file(text_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        text_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not info["missing_keys"], info
    mine = load_model(text_dir, dtype=torch.float32)
    for b, t in [(1, 100), (2, 7)]:
        ids = _ids(b, t, seed=100 + t)
        with torch.no_grad():
            want = model.eval()(input_ids=ids).logits
            got = mine(ids)
            assert torch.equal(got, ours(ids))  # per-expert VLM and fused text layouts agree
        assert (got - want).abs().max().item() <= TOL


def test_params_to_checkpoint_is_the_released_layout(vlm_dir, ours):
    stored = load_file(vlm_dir / "model.safetensors")
    written = q35.params_to_checkpoint(ours.state_dict(), ours.cfg)
    assert set(written) == {k for k in stored if not k.startswith("model.visual.")}
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in written
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in written
    for k, v in written.items():
        assert torch.allclose(v, stored[k], atol=1e-6), k


# ---- MTP: compared with a reference composed here from *_ref ops and the raw checkpoint ----


def _norm(x, w_stored):
    return rms_norm_ref(x, 1.0 + w_stored, 1e-6)  # zero-centred in the checkpoint


def _mtp_reference(w: dict, cfg: q35.Config, hidden, embeds, pos):
    p = "mtp.layers.0."
    x = torch.cat((_norm(embeds, w["mtp.pre_fc_norm_embedding.weight"]),
                   _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])), -1) @ w["mtp.fc.weight"].T
    b, t, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h = _norm(x, w[p + "input_layernorm.weight"])
    q, gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, hq, 2 * d).chunk(2, -1)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, hkv, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, hkv, d)
    # Text positions are equal on the t/h/w axes, so mRoPE reduces to plain partial RoPE.
    r = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2).float() / r))
    freqs = pos.float()[..., None] * inv
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q = rope_ref(_norm(q, w[p + "self_attn.q_norm.weight"]), cos, sin)
    k = rope_ref(_norm(k, w[p + "self_attn.k_norm.weight"]), cos, sin)
    o = attention_ref(q, k, v, d**-0.5).reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    h = _norm(x, w[p + "post_attention_layernorm.weight"]).reshape(b * t, -1)
    probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
    top_w, top_i = probs.topk(cfg.num_experts_per_tok, -1)
    e = range(cfg.num_experts)
    gate_up = torch.stack([torch.cat((w[f"{p}mlp.experts.{i}.gate_proj.weight"],
                                      w[f"{p}mlp.experts.{i}.up_proj.weight"])) for i in e])
    down = torch.stack([w[f"{p}mlp.experts.{i}.down_proj.weight"] for i in e])
    moe = moe_experts_ref(h, top_i, top_w / top_w.sum(-1, keepdim=True), gate_up, down, "swiglu")
    s = p + "mlp.shared_expert."
    shared = (F.silu(h @ w[s + "gate_proj.weight"].T) * (h @ w[s + "up_proj.weight"].T)) \
        @ w[s + "down_proj.weight"].T
    moe = moe + torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * shared
    out = _norm(x + moe.view(b, t, -1), w["mtp.norm.weight"])
    return out, out @ w["lm_head.weight"].T


def test_mtp_matches_reference(vlm_dir, ours):
    w = load_file(vlm_dir / "model.safetensors")
    ids = _ids(2, 33, seed=7)
    pos = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        hidden = ours.forward_hidden(ids[:, :-1], pos)  # final-normed target feature
        embeds = ours.model.embed_tokens(ids[:, 1:])  # embedding of the *next* token
        got = ours.mtp(hidden, embeds, pos)
    want_hidden, want_logits = _mtp_reference(w, ours.cfg, hidden, embeds, pos)
    assert (got.hidden - want_hidden).abs().max().item() <= TOL
    assert (got.logits - want_logits).abs().max().item() <= TOL
    assert not any(n.startswith(("mtp.embed", "mtp.lm_head")) for n, _ in ours.named_parameters())


def test_missing_mtp_weights_are_named(tmp_path):
    q35.make_tiny(tmp_path, seed=1, mtp_layers=0)
    assert not hasattr(load_model(tmp_path, dtype=torch.float32), "mtp")
    with pytest.raises(CheckpointError, match=r"MTP weights.*mtp\.fc\.weight"):
        load_model(tmp_path, dtype=torch.float32, with_mtp=True)
