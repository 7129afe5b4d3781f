from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import specdeploy.ops  # noqa: F401
from specdeploy.ops import rope_cos_sin

OPS = ("attention", "rms_norm", "gated_rms_norm", "rope", "causal_conv1d", "ssm_scan",
       "gated_delta_rule", "moe_experts")


class Tiny(torch.nn.Module):
    """Every canonical op once, with shapes derived from T."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.norm_w = torch.nn.Parameter(torch.ones(16))
        self.conv_w = torch.nn.Parameter(torch.randn(16, 4))
        self.A = torch.nn.Parameter(-torch.rand(2))
        self.w_up = torch.nn.Parameter(torch.randn(3, 8, 16) * 0.1)
        self.w_down = torch.nn.Parameter(torch.randn(3, 16, 4) * 0.1)

    def forward(self, x, pos):
        b, t, _ = x.shape
        ops = torch.ops.specdeploy
        x = ops.rms_norm(x, self.norm_w, 1e-6)
        cos, sin = rope_cos_sin(pos, self.inv_freq, [2, 1, 1], mrope_interleaved=True)
        q = ops.rope(x.view(b, t, 2, 8), cos, sin)
        a = ops.attention(q, q[:, :, :1], q[:, :, :1], 0.3, 4).reshape(b, t, 16)
        c, _ = ops.causal_conv1d(a, self.conv_w, None, None, "silu")
        y, _ = ops.ssm_scan(c.view(b, t, 2, 8), c[..., :2], self.A, c[..., None, :4],
                            c[..., None, 4:8], self.A, self.A, 0.0, 10.0, 8, None)
        o, _ = ops.gated_delta_rule(y, y, y, -c[..., 8:10].abs(), c[..., 10:12].sigmoid(), None,
                                    True, 0.0, 8)
        h = ops.gated_rms_norm(o.reshape(b, t, 16), c, self.norm_w, 1e-6, 8, True)
        r = specdeploy.ops.route_softmax_topk(h.view(-1, 16)[:, :3], 2, True)
        m = ops.moe_experts(h.view(-1, 16), r.ids, r.weights, self.w_up, self.w_down, "swiglu")
        return m.view(b, t, 16)


def test_export_with_dynamic_t_keeps_ops_as_nodes():
    model = Tiny()
    x, pos = torch.randn(2, 11, 16), torch.arange(11).expand(2, 11)
    t = torch.export.Dim("t", min=2, max=512)
    ep = torch.export.export(model, (x, pos), dynamic_shapes=({1: t}, {1: t}))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in OPS:
        assert f"specdeploy.{name}.default" in targets, name
    x2, pos2 = torch.randn(2, 37, 16), torch.arange(37).expand(2, 37)
    torch.testing.assert_close(ep.module()(x2, pos2), model(x2, pos2))


def test_fake_kernels_give_contract_shapes():
    ops = torch.ops.specdeploy
    with FakeTensorMode():
        q, kv = torch.empty(2, 5, 4, 8), torch.empty(2, 5, 2, 8)
        assert ops.attention(q, kv, torch.empty(2, 5, 2, 6), 1.0, 0).shape == (2, 5, 4, 6)
        y, s = ops.causal_conv1d(torch.empty(2, 5, 6), torch.empty(6, 4), None, None, "none")
        assert (y.shape, s.shape) == ((2, 5, 6), (2, 6, 3))
        y, s = ops.ssm_scan(torch.empty(2, 5, 4, 3).bfloat16(), torch.empty(2, 5, 4),
                            torch.empty(4), torch.empty(2, 5, 2, 7), torch.empty(2, 5, 2, 7),
                            torch.empty(4), torch.empty(4), 0.0, 1.0, 4, None)
        assert (y.shape, y.dtype) == ((2, 5, 4, 3), torch.bfloat16)
        assert (s.shape, s.dtype) == ((2, 4, 3, 7), torch.float32)
        o, s = ops.gated_delta_rule(torch.empty(2, 5, 4, 8), torch.empty(2, 5, 4, 8),
                                    torch.empty(2, 5, 4, 6), torch.empty(2, 5, 4),
                                    torch.empty(2, 5, 4), None, True, 0.0, 64)
        assert (o.shape, s.shape) == ((2, 5, 4, 6), (2, 4, 8, 6))
