"""Commit promotes exactly the state after the last accepted token.

Oracle: a fresh non-speculative deployment prefilled with exactly the committed tokens (its own
states are tested against the `*_ref` recurrences in tests/deploy and tests/ops), and, at the op
level, the `*_ref` recurrences themselves.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.engine.request import SamplingParams
from specdeploy.ops import causal_conv1d_ref, gated_delta_rule_ref, ssm_scan_ref
from specdeploy.ops.cached_recurrent import (
    cached_causal_conv1d,
    cached_gated_delta_rule,
    cached_ssm_scan,
)
from tests.spec.tiny_targets import LIMITS

K = 3
LIMITS_1 = dict(LIMITS, max_batch_size=2)


def _greedy(target, prompt, n):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return target.llm().generate([prompt], params)[0].token_ids


def _states(deployed, slot):
    gm = deployed.gm
    return {name: buf[slot].clone() for name, buf in gm.named_buffers()
            if name.endswith("_state") and "spec" not in name}


@pytest.mark.parametrize("accepted", range(0, K + 1))
def test_committed_state_equals_state_after_accepted_tokens(target, accepted):
    if target.arch == "llama":
        pytest.skip("no recurrent state")
    prompt = target.prompts[1]
    cont = _greedy(target, prompt, 2 * K + 2)
    eng = target.llm(K).engine

    def propose(seq, k):  # exactly `accepted` right drafts, then wrong ones
        start = len(seq.output_ids)
        right = cont[start:start + k]
        return [t if i < accepted else (t + 1) % 100 for i, t in enumerate(right)]

    eng.fix_drafts(propose)
    eng.add_request(prompt, SamplingParams(max_tokens=2 * K + 2, ignore_eos=True))
    eng.step()  # prefill + first drafts
    (seq,) = [s for s in eng._seqs.values() if not s.finished]
    before = seq.num_cached
    eng.step()  # verify
    assert seq.num_cached == before + 1 + accepted
    assert seq.output_ids == cont[: 2 + accepted]
    ref = target.llm().deployed  # idle between tests: its slot 0 and first pages are free
    ids = seq.all_ids[: seq.num_cached]
    ref.forward(build_metadata([Segment(ids, 0, list(range(8)), 0)]))
    target.llm().reset_prefix_cache()  # its pages were written behind its engine's back
    got, want = _states(eng.deployed.target, seq.slot), _states(ref, 0)
    eng.abort(seq.request_id)
    eng.step()
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_op_level_commit_matches_refs(n):
    """EXTEND writes per-token states; promoting entry n-1 gives the ref state after n tokens."""
    torch.manual_seed(0)
    steps, prefix, total = 4, 5, 5 + 4
    c, w = 6, 4
    x = torch.randn(1, total, c)
    wt, bias = torch.randn(c, w), torch.randn(c)
    state = torch.zeros(2, c, w - 1)
    spec = torch.zeros(2, steps, c, w - 1)

    def meta(a, b, cache, kind):
        return dict(cu_seqlens_host=torch.tensor([0, b - a]), cache_lens_host=torch.tensor([cache]),
                    slot_idx=torch.tensor([1]), seg_kind_host=torch.tensor([kind]))

    cached_causal_conv1d(x[:, :prefix], wt, bias, state, spec, **meta(0, prefix, 0, 0))
    cached_causal_conv1d(x[:, prefix:], wt, bias, state, spec, **meta(prefix, total, prefix,
                                                                       SEG_EXTEND))
    _, want = causal_conv1d_ref(x[:, :prefix + n], wt, bias)
    torch.testing.assert_close(spec[1, n - 1], want[0], rtol=1e-5, atol=1e-6)

    h, p, g, nn_ = 4, 3, 2, 5
    xs, dt = torch.randn(1, total, h, p), torch.randn(1, total, h)
    A, D, dtb = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h) * 0.1
    B, C = torch.randn(1, total, g, nn_), torch.randn(1, total, g, nn_)
    s_state, s_spec = torch.zeros(2, h, p, nn_), torch.zeros(2, steps, h, p, nn_)
    for a, b, kind in ((0, prefix, 0), (prefix, total, SEG_EXTEND)):
        cached_ssm_scan(xs[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, dtb, s_state, s_spec,
                        dt_min=0.0, dt_max=float("inf"), chunk_size=4, **meta(a, b, a, kind))
    _, want = ssm_scan_ref(xs[:, :prefix + n], dt[:, :prefix + n], A, B[:, :prefix + n],
                           C[:, :prefix + n], D, dtb, 0.0, float("inf"), 4)
    torch.testing.assert_close(s_spec[1, n - 1], want[0], rtol=1e-4, atol=1e-5)

    hk, dk, dv = 2, 4, 3
    q, k = torch.randn(1, total, hk, dk), torch.randn(1, total, hk, dk)
    v = torch.randn(1, total, hk, dv)
    gg, beta = -torch.rand(1, total, hk), torch.rand(1, total, hk)
    d_state, d_spec = torch.zeros(2, hk, dk, dv), torch.zeros(2, steps, hk, dk, dv)
    for a, b, kind in ((0, prefix, 0), (prefix, total, SEG_EXTEND)):
        cached_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gg[:, a:b], beta[:, a:b],
                                d_state, d_spec, use_qk_l2norm=True, scale=0.0, chunk_size=4,
                                **meta(a, b, a, kind))
    m = prefix + n
    _, want = gated_delta_rule_ref(q[:, :m], k[:, :m], v[:, :m], gg[:, :m], beta[:, :m],
                                   use_qk_l2norm=True)
    torch.testing.assert_close(d_spec[1, n - 1], want[0], rtol=1e-4, atol=1e-5)
    # the main slots hold the prefix state only: EXTEND never touches them
    _, conv_prefix = causal_conv1d_ref(x[:, :prefix], wt, bias)
    torch.testing.assert_close(state[1], conv_prefix[0], rtol=1e-5, atol=1e-6)
