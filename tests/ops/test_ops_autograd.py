"""Backward through the ops (drafter training) equals backward through the pure-torch refs."""

from __future__ import annotations

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops import (
    attention_ref,
    causal_conv1d_ref,
    gated_delta_rule_ref,
    gated_rms_norm_ref,
    moe_experts_ref,
    rms_norm_ref,
    rope_cos_sin,
    rope_ref,
    ssm_scan_ref,
)

ops = torch.ops.specdeploy


def _cases():
    t = 9
    cos, sin = rope_cos_sin(torch.arange(t)[None], torch.rand(3))
    ids = torch.randint(0, 3, (t, 2))
    yield "attention", ops.attention, attention_ref, (
        torch.randn(1, t, 4, 8), torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8), 0.3, 4)
    yield "rms_norm", ops.rms_norm, rms_norm_ref, (torch.randn(t, 16), torch.randn(16), 1e-6)
    yield "gated_rms_norm", ops.gated_rms_norm, gated_rms_norm_ref, (
        torch.randn(t, 16), torch.randn(t, 16), torch.randn(16), 1e-6, 8, False)
    yield "rope", ops.rope, rope_ref, (torch.randn(1, t, 2, 8), cos, sin)
    yield "conv", ops.causal_conv1d, causal_conv1d_ref, (
        torch.randn(1, t, 6), torch.randn(6, 4), torch.randn(6), torch.randn(1, 6, 3), "silu")
    yield "ssm", ops.ssm_scan, ssm_scan_ref, (
        torch.randn(1, t, 2, 3), torch.randn(1, t, 2), -torch.rand(2), torch.randn(1, t, 1, 4),
        torch.randn(1, t, 1, 4), torch.randn(2), torch.randn(2), 1e-3, 10.0, 4,
        torch.randn(1, 2, 3, 4))
    yield "gdn", ops.gated_delta_rule, gated_delta_rule_ref, (
        torch.randn(1, t, 2, 4), torch.randn(1, t, 2, 4), torch.randn(1, t, 2, 3),
        -torch.rand(1, t, 2), torch.rand(1, t, 2), torch.randn(1, 2, 4, 3), True, 0.5, 4)
    yield "moe", ops.moe_experts, moe_experts_ref, (
        torch.randn(t, 8), ids, torch.rand(t, 2), torch.randn(3, 10, 8), torch.randn(3, 8, 5),
        "swiglu")


def _grads(fn, args):
    leaves = [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor)
              and a.is_floating_point() else a for a in args]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.manual_seed(1)
    loss = sum((o * torch.randn(o.shape)).sum() for o in outs)  # randn_like follows strides
    loss.backward()
    return [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_op_backward_matches_ref(close, case):
    _, op, ref, args = case
    for got, want in zip(_grads(op, args), _grads(ref, args)):
        close(got, want, rtol=1e-4)
