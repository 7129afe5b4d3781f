from __future__ import annotations

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops.gdn import gated_delta_rule_core, gated_delta_rule_ref

LENGTHS = (1, 7, 63, 130)


def _inputs(t, b=2, h=3, dk=8, dv=6, hk=None):
    hk = hk or h
    return (
        torch.randn(b, t, hk, dk),
        torch.randn(b, t, hk, dk),
        torch.randn(b, t, h, dv),
        -torch.rand(b, t, h) * 2,  # log decay
        torch.rand(b, t, h),
    )


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("with_state", (False, True))
@pytest.mark.parametrize("chunk_size", (16, 64))
def test_gdn_chunked_matches_recurrence(close, t, with_state, chunk_size):
    q, k, v, g, beta = _inputs(t)
    s0 = torch.randn(2, 3, 8, 6) if with_state else None
    o, state = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, s0, True, 0.3, chunk_size)
    o_ref, state_ref = gated_delta_rule_ref(q, k, v, g, beta, s0, True, 0.3)
    close(o, o_ref)
    close(state, state_ref)


def test_gdn_without_l2norm(close):
    # unnormalized keys must stay small for the delta rule to be contractive
    q, k, v, g, beta = _inputs(63)
    k = k * 0.2
    o, state = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, None, False, 0.35, 16)
    o_ref, state_ref = gated_delta_rule_ref(q, k, v, g, beta, None, False, 0.35)
    close(o, o_ref)
    close(state, state_ref)


def test_gdn_default_scale_and_grouped_value_heads(close):
    q, k, v, g, beta = _inputs(7, h=4, hk=2)
    o, _ = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, None, True, 0.0)
    rep = lambda t: t.repeat_interleave(2, dim=2)  # noqa: E731
    o_ref, _ = gated_delta_rule_ref(rep(q), rep(k), v, g, beta, None, True, 8**-0.5)
    close(o, o_ref)


@pytest.mark.parametrize("split", (1, 40, 100))
def test_gdn_chunking_invariance(close, split):
    q, k, v, g, beta = _inputs(130)
    s0 = torch.randn(2, 3, 8, 6)
    o, state = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, s0, True, 0.3, 32)
    a, b = slice(None, split), slice(split, None)
    parts = [tuple(x[:, s] for x in (q, k, v, g, beta)) for s in (a, b)]
    o1, s1 = torch.ops.specdeploy.gated_delta_rule(*parts[0], s0, True, 0.3, 32)
    o2, s2 = torch.ops.specdeploy.gated_delta_rule(*parts[1], s1, True, 0.3, 32)
    close(torch.cat((o1, o2), dim=1), o)
    close(s2, state)


def test_gdn_per_token_states(close):
    q, k, v, g, beta = _inputs(19)
    s0 = torch.randn(2, 3, 8, 6)
    out = gated_delta_rule_core(q, k, v, g, beta, s0, True, 0.3, 8, return_states=True)
    for i in (0, 7, 8, 18):
        prefix = (x[:, : i + 1] for x in (q, k, v, g, beta))
        close(out.states[:, i], gated_delta_rule_ref(*prefix, s0, True, 0.3)[1])


def test_gdn_bf16_inputs_keep_dtype(close):
    q, k, v, g, beta = (x.bfloat16() for x in _inputs(9))
    o, state = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, None, True, 0.3, 4)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    o_ref, _ = gated_delta_rule_ref(q, k, v, g, beta, None, True, 0.3)
    close(o.float(), o_ref.float(), rtol=2e-2)


def test_gdn_strong_decay_stays_finite(close):
    q, k, v, g, beta = _inputs(130)
    g = g * 15  # exp(cumulative decay) underflows inside a 64-token chunk
    o, state = torch.ops.specdeploy.gated_delta_rule(q, k, v, g, beta, None, True, 0.3, 64)
    o_ref, state_ref = gated_delta_rule_ref(q, k, v, g, beta, None, True, 0.3)
    assert torch.isfinite(o).all()
    close(o, o_ref)
    close(state, state_ref)
