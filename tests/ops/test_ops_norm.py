from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specdeploy.ops  # noqa: F401


def test_rms_norm(close):
    x, w = torch.randn(2, 5, 32), torch.randn(32)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    close(torch.ops.specdeploy.rms_norm(x, w, 1e-5), expected)


def test_rms_norm_bf16_returns_input_dtype():
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16)
    assert torch.ops.specdeploy.rms_norm(x, w, 1e-6).dtype == torch.bfloat16


def _group_rms(x, group, eps):
    g = x.unflatten(-1, (-1, group))
    return (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


@pytest.mark.parametrize("group", (8, 32))
def test_gated_rms_norm_gate_before_norm(close, group):
    x, z, w = torch.randn(2, 3, 32), torch.randn(2, 3, 32), torch.randn(32)
    out = torch.ops.specdeploy.gated_rms_norm(x, z, w, 1e-5, group, False)
    close(out, _group_rms(x * F.silu(z), group, 1e-5) * w)


def test_gated_rms_norm_norm_before_gate(close):
    x, z, w = torch.randn(7, 16), torch.randn(7, 16), torch.randn(16)
    out = torch.ops.specdeploy.gated_rms_norm(x, z, w, 1e-6, 16, True)
    close(out, _group_rms(x, 16, 1e-6) * w * F.silu(z))
