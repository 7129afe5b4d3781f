"""NemotronH: logits equal transformers' (fp32, pure-torch Mamba path), checkpoint layouts, MTP."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h as nh
from specdeploy.models.registry import family_module
from specdeploy.ops import attention_ref, moe_experts_ref, rms_norm_ref, route_sigmoid

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def _oracle(path):
    # eager attention; without mamba_ssm / causal_conv1d transformers runs its torch fallbacks
    model, info = transformers.NemotronHForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return nh.make_tiny(tmp_path_factory.mktemp("nemotron_h"), seed=0, mtp_layers=1)


@pytest.fixture(scope="module")
def oracle(tiny):
    return _oracle(tiny)


@pytest.fixture(scope="module")
def ours(tiny):
    return load_model(tiny, dtype="float32", with_mtp=True)


def _ids(batch, length, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("batch,length", [(1, 1), (1, 7), (2, 33)])
def test_logits_match_transformers(ours, oracle, batch, length):
    ids = _ids(batch, length, seed=length)
    want = oracle(ids).logits
    got = ours(ids)
    assert got.shape == (batch, length, 128)
    assert (got - want).abs().max().item() <= TOL
    assert want.std() > 0.1  # the tiny weights give non-degenerate logits
    hidden = oracle.model(ids).last_hidden_state
    assert (ours.forward_hidden(ids) - hidden).abs().max().item() <= TOL


@torch.no_grad()
def test_variant_list_config_no_latent_matches_transformers(tmp_path):
    """`layers_block_type` list form, no MoE latent projection, ungrouped routing, biases."""
    hf = nh.tiny_hf_config()
    del hf["hybrid_override_pattern"], hf["moe_latent_size"]
    hf.update(layers_block_type=["mlp", "linear_attention", "moe", "full_attention", "moe"],
              num_hidden_layers=5, n_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
              use_bias=True, mlp_bias=True)
    path = nh.make_tiny(tmp_path, seed=3, hf_config=hf)
    cfg = nh.Config.from_hf(hf)
    assert cfg.block_types == ("mlp", "mamba", "moe", "attention", "moe")
    assert cfg.moe_latent_size is None
    ids = _ids(2, 19)
    got = load_model(path, dtype="float32")(ids)
    # NOTE: use_cache=False: transformers 5.25's cache reads its first layer's length, and an
    # MLP first layer holds no cache (DummyLayer has no get_seq_length); one forward needs none
    assert (got - _oracle(path)(ids, use_cache=False).logits).abs().max().item() <= TOL


def test_config_from_hf_forms():
    hf = nh.tiny_hf_config(mtp_layers=2)
    cfg = nh.Config.from_hf(hf)
    assert cfg.block_types == ("mamba", "attention", "mamba", "mlp", "moe", "attention", "mamba",
                               "moe")
    assert cfg.mtp_block_types == ("attention", "moe") and cfg.num_nextn_predict_layers == 2
    legacy = {k: v for k, v in hf.items() if k not in ("n_groups", "conv_kernel", "chunk_size")}
    legacy.update(mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16,
                  mtp_layers_block_type=["full_attention", "moe"])
    assert nh.Config.from_hf(legacy) == cfg
    assert nh.Config.from_hf({"text_config": hf, "architectures": hf["architectures"]}) == cfg
    assert family_module("NemotronHForCausalLM") is nh
    with pytest.raises(ValueError, match="mlp_hidden_act"):
        nh.Config.from_hf({**hf, "mlp_hidden_act": "silu"})


@torch.no_grad()
def test_transformers_layout_model_prefix_fused_experts(tmp_path, tiny, ours, oracle):
    """transformers' in-memory state dict: `model.*` keys and fused 3-D expert tensors."""
    sd = oracle.state_dict()
    assert "model.layers.4.mixer.experts.up_proj" in sd  # fused [E, I, H']
    path = write_checkpoint(tmp_path / "hf_memory", oracle.config.to_dict(), sd)
    ids = _ids(1, 9)
    assert torch.equal(load_model(path, dtype="float32")(ids), ours(ids))
    # the VLM root (`language_model.backbone.*`, `language_model.mtp.*`)
    w = load_file(str(tiny / "model.safetensors"))
    vlm = write_checkpoint(tmp_path / "vlm", nh.tiny_hf_config(mtp_layers=1),
                           {"language_model." + k: v for k, v in w.items()})
    m = load_model(vlm, dtype="float32", with_mtp=True)
    assert torch.equal(m(ids), ours(ids))
    assert torch.equal(m.mtp.layers[0].eh_proj.weight, ours.mtp.layers[0].eh_proj.weight)
    # and what transformers writes with save_pretrained
    oracle.save_pretrained(tmp_path / "saved")
    assert torch.equal(load_model(tmp_path / "saved", dtype="float32")(ids), ours(ids))


def test_params_to_checkpoint_is_released_layout(tiny, ours):
    keys = set(load_file(str(tiny / "model.safetensors")))
    assert "backbone.layers.4.mixer.experts.7.down_proj.weight" in keys
    assert "mtp.layers.0.eh_proj.weight" in keys and "mtp.layers.1.final_layernorm.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    assert set(nh.params_to_checkpoint(ours.state_dict(), ours.cfg)) == keys
    # shared embedding / head are not the drafter's own parameters
    assert all(not k.startswith(("embed", "lm_head")) for k, _ in ours.mtp.named_parameters())


def _mtp_ref(w, cfg, hidden, embeds, group):
    """One draft step from raw checkpoint tensors, `*_ref` ops and plain torch."""
    n = len(cfg.mtp_block_types)

    def p(i, name):
        return w[f"mtp.layers.{group * n + i}.{name}"]

    def norm(x, key):
        return rms_norm_ref(x, key, cfg.eps)

    x = torch.cat([norm(embeds, p(0, "enorm.weight")), norm(hidden, p(0, "hnorm.weight"))], -1)
    x = x @ p(0, "eh_proj.weight").T
    for i, kind in enumerate(cfg.mtp_block_types):
        y = norm(x, p(i, "norm.weight"))
        if kind == "attention":
            d = cfg.head_dim
            q, k, v = (y @ p(i, f"mixer.{c}_proj.weight").T for c in "qkv")
            b, t = y.shape[:2]
            o = attention_ref(q.view(b, t, -1, d), k.view(b, t, -1, d), v.view(b, t, -1, d),
                              d**-0.5)
            out = o.reshape(b, t, -1) @ p(i, "mixer.o_proj.weight").T
        else:
            assert kind == "moe"
            flat = y.reshape(-1, y.shape[-1])
            r = route_sigmoid(flat @ p(i, "mixer.gate.weight").T,
                              p(i, "mixer.gate.e_score_correction_bias"), cfg.num_experts_per_tok,
                              cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                              cfg.routed_scaling_factor)
            up, down = (torch.stack([p(i, f"mixer.experts.{e}.{j}_proj.weight")
                                     for e in range(cfg.n_routed_experts)]) for j in ("up", "down"))
            lat = flat @ p(i, "mixer.fc1_latent_proj.weight").T
            routed = moe_experts_ref(lat, r.ids, r.weights, up, down, "relu2")
            routed = routed @ p(i, "mixer.fc2_latent_proj.weight").T
            shared = F.relu(y @ p(i, "mixer.shared_experts.up_proj.weight").T).square()
            out = routed.view(y.shape) + shared @ p(i, "mixer.shared_experts.down_proj.weight").T
        x = x + out
    h = norm(x, p(n - 1, "final_layernorm.weight"))
    return h, h @ w["lm_head.weight"].T


@torch.no_grad()
@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_mtp_matches_reference(tmp_path, mtp_layers):
    path = nh.make_tiny(tmp_path, seed=5, mtp_layers=mtp_layers)
    model = load_model(path, dtype="float32", with_mtp=True)
    w = load_file(str(path / "model.safetensors"))
    ids = _ids(2, 11)
    hidden = model.forward_hidden(ids)  # target's final-normed hidden at positions 0..T-1
    embeds = model.mtp.embed(torch.roll(ids, -1, dims=1))  # token after each position
    pos = torch.arange(11).expand(2, 11)
    for step in range(mtp_layers + 1):
        out = model.mtp(hidden, embeds, pos, step=step)
        # draft step j runs group min(j, G - 1) (drafters/nemotron_h_mtp.py)
        want_h, want_logits = _mtp_ref(w, model.cfg, hidden, embeds, min(step, mtp_layers - 1))
        assert out.hidden.shape == (2, 11, 64) and out.logits.shape == (2, 11, 128)
        assert (out.hidden - want_h).abs().max().item() <= 1e-5
        assert (out.logits - want_logits).abs().max().item() <= 1e-5
        hidden = out.hidden  # the next draft step is fed the drafter's own hidden


def test_missing_mtp_weights_named(tmp_path, tiny):
    w = load_file(str(tiny / "model.safetensors"))
    dropped = {k: v for k, v in w.items() if k != "mtp.layers.0.eh_proj.weight"
               and not k.startswith("mtp.layers.1.mixer.experts.")}
    path = write_checkpoint(tmp_path, nh.tiny_hf_config(mtp_layers=1), dropped)
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.eh_proj\.weight"):
        load_model(path, with_mtp=True)
    load_model(path)  # the target alone still loads
