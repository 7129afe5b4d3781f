"""The canonical ops against transformers' own torch code (the semantics we must match)."""

from __future__ import annotations

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops import rope_cos_sin, route_sigmoid, route_softmax_topk

transformers = pytest.importorskip("transformers")
nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
qm = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _nemotron_config(**kw):
    base = dict(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=12,
                mlp_hidden_act="relu2")
    return transformers.NemotronHConfig(**(base | kw))


def _qwen_config(**kw):
    base = dict(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                head_dim=128, num_attention_heads=2, partial_rotary_factor=0.5)
    return transformers.Qwen3_5MoeTextConfig(**(base | kw))


@pytest.mark.parametrize("t", (1, 7, 63, 130))
def test_ssm_scan_matches_hf_chunk_scan(close, t):
    b, h, p, g, n = 2, 4, 3, 2, 5
    x, dt = torch.randn(b, t, h, p), torch.randn(b, t, h)
    A, D, dt_bias = -torch.rand(h) * 4, torch.randn(h), torch.randn(h)
    B, C, s0 = torch.randn(b, t, g, n), torch.randn(b, t, g, n), torch.randn(b, h, p, n)
    y_hf, s_hf = nh.mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=32, D=D, dt_bias=dt_bias, initial_states=s0, dt_softplus=True,
        dt_limit=(1e-3, float("inf")), return_final_states=True,
    )
    y, s = torch.ops.specdeploy.ssm_scan(x, dt, A, B, C, D, dt_bias, 1e-3, float("inf"), 32, s0)
    close(y, y_hf)
    close(s, s_hf)


@pytest.mark.parametrize("t", (1, 7, 63, 130))
def test_gated_delta_rule_matches_hf_chunk(close, t):
    b, hk, hv, dk, dv = 2, 2, 4, 16, 8
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v, beta = torch.randn(b, t, hv, dv), torch.rand(b, t, hv)
    g, s0 = -torch.rand(b, t, hv) * 2, torch.randn(b, hv, dk, dv)
    o_hf, s_hf = qm.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, s = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, s0, True, dk**-0.5)
    close(o, o_hf)
    close(s, s_hf)


def test_causal_conv1d_matches_hf(close):
    x, w, bias = torch.randn(2, 9, 6), torch.randn(6, 4), torch.randn(6)
    y_hf = nh.causal_conv1d_fn(x.transpose(1, 2), w, bias, activation="silu").transpose(1, 2)
    close(torch.ops.specdeploy.causal_conv1d(x, w, bias, None, "silu")[0], y_hf)


def test_gated_norms_match_hf(close):
    x, z = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    mamba = nh.NemotronHRMSNormGated(32, group_size=8, eps=1e-5)
    qwen = qm.Qwen3_5MoeRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        mamba.weight.normal_()
        qwen.weight.normal_()
        close(torch.ops.specdeploy.gated_rms_norm(x, z, mamba.weight, 1e-5, 8, False), mamba(x, z))
        close(torch.ops.specdeploy.gated_rms_norm(x, z, qwen.weight, 1e-6, 32, True), qwen(x, z))


def test_mrope_cos_sin_and_rope_match_hf(close):
    cfg = _qwen_config()
    emb = qm.Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.stack([torch.arange(7), torch.arange(7) * 2 + 1, torch.arange(7) % 3])[:, None]
    x = torch.randn(1, 7, 2, 128)
    cos_hf, sin_hf = emb(x, pos)
    cos, sin = rope_cos_sin(pos, emb.inv_freq, emb.mrope_section, mrope_interleaved=True)
    close(cos, cos_hf)
    close(sin, sin_hf)
    q_hf, _ = qm.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos_hf, sin_hf)
    close(torch.ops.specdeploy.rope(x, cos, sin), q_hf.transpose(1, 2))


def test_sigmoid_routing_and_relu2_experts_match_hf(close):
    cfg = _nemotron_config()
    router, experts = nh.NemotronHTopkRouter(cfg), nh.NemotronHExperts(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.5)
        experts.up_proj.normal_(std=0.3)
        experts.down_proj.normal_(std=0.3)
        x = torch.randn(11, 16)
        logits, w_hf, ids_hf = router(x)
        r = route_sigmoid(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
        order, order_hf = r.ids.sort(-1).indices, ids_hf.sort(-1).indices
        assert torch.equal(r.ids.gather(1, order), ids_hf.gather(1, order_hf))
        close(r.weights.gather(1, order), w_hf.gather(1, order_hf))
        out = torch.ops.specdeploy.moe_experts(
            x, r.ids, r.weights, experts.up_proj, experts.down_proj, "relu2"
        )
        close(out, experts(x, ids_hf, w_hf))


def test_softmax_routing_and_swiglu_experts_match_hf(close):
    cfg = _qwen_config()
    router, experts = qm.Qwen3_5MoeTopKRouter(cfg), qm.Qwen3_5MoeExperts(cfg)
    with torch.no_grad():
        router.weight.normal_()
        experts.gate_up_proj.normal_(std=0.3)
        experts.down_proj.normal_(std=0.3)
        x = torch.randn(11, 16)
        logits, w_hf, ids_hf = router(x)
        r = route_softmax_topk(logits, 2, renormalize=True)
        assert torch.equal(r.ids, ids_hf)
        close(r.weights, w_hf)
        out = torch.ops.specdeploy.moe_experts(
            x, r.ids, r.weights, experts.gate_up_proj, experts.down_proj, "swiglu"
        )
        close(out, experts(x, ids_hf, w_hf))
