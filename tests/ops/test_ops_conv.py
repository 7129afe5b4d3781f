from __future__ import annotations

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops.conv import causal_conv1d_core, causal_conv1d_ref

LENGTHS = (1, 7, 63, 130)


def _inputs(t, c=6, w=4, b=2):
    return torch.randn(b, t, c), torch.randn(c, w), torch.randn(c), torch.randn(b, c, w - 1)


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("with_state", (False, True))
@pytest.mark.parametrize("activation,with_bias", [("silu", True), ("none", False)])
def test_conv_matches_ref(close, t, with_state, activation, with_bias):
    x, w, bias, s0 = _inputs(t)
    bias = bias if with_bias else None
    s0 = s0 if with_state else None
    y, state = torch.ops.specdeploy.causal_conv1d(x, w, bias, s0, activation)
    y_ref, state_ref = causal_conv1d_ref(x, w, bias, s0, activation)
    close(y, y_ref)
    close(state, state_ref)


def test_conv_final_state_is_last_inputs():
    x, w, bias, _ = _inputs(7)
    _, state = torch.ops.specdeploy.causal_conv1d(x, w, bias, None, "silu")
    assert torch.equal(state, x[:, -3:].transpose(1, 2))
    _, short = torch.ops.specdeploy.causal_conv1d(x[:, :1], w, bias, None, "silu")
    assert torch.equal(short[..., :2], torch.zeros(2, 6, 2))
    assert torch.equal(short[..., 2], x[:, 0])


@pytest.mark.parametrize("split", (1, 5, 62))
def test_conv_chunking_invariance(close, split):
    x, w, bias, s0 = _inputs(63)
    y, state = torch.ops.specdeploy.causal_conv1d(x, w, bias, s0, "silu")
    y1, s1 = torch.ops.specdeploy.causal_conv1d(x[:, :split], w, bias, s0, "silu")
    y2, s2 = torch.ops.specdeploy.causal_conv1d(x[:, split:], w, bias, s1, "silu")
    close(torch.cat((y1, y2), dim=1), y)
    close(s2, state)


def test_conv_per_token_states(close):
    x, w, bias, s0 = _inputs(7)
    out = causal_conv1d_core(x, w, bias, s0, "silu", return_states=True)
    for i in range(7):
        close(out.states[:, i], causal_conv1d_ref(x[:, : i + 1], w, bias, s0, "silu")[1])
