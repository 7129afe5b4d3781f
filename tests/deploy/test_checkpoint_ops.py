"""Prefix-cache checkpoints written by the recurrent cached ops: the state after a chosen token
of a NORMAL segment, wherever it falls in the scan's chunks (first token, chunk ends, mid-chunk,
last token, a decode token), in a mixed batch. Oracle: the token-by-token `*_ref` recurrences
(fp32; rtol 1e-4 / atol 1e-5, as for the spec states)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import causal_conv1d_ref, gated_delta_rule_ref, ssm_scan_ref
from specdeploy.ops.cached_recurrent import (
    cached_causal_conv1d,
    cached_gated_delta_rule,
    cached_ssm_scan,
)

# (cached tokens before the step, tokens fed, checkpointed offsets); chunk size 4: several
# offsets in one chunk (chained), at chunk ends and at the last token (free), a decode token
SEGMENTS = [(0, 19, [0, 1, 3, 4, 9, 10, 18]), (5, 11, [2, 5, 6, 10]), (7, 1, [0]), (3, 1, [])]
CHUNK = 4


def _batch(make, ref_state):
    """Per segment: inputs of its whole history; returns flat step inputs, initial slot states,
    ckpt metadata and the oracle states."""
    torch.manual_seed(0)
    hist = [make(c + n) for c, n, _ in SEGMENTS]
    steps = [[x[:, c:] for x in h] for h, (c, _, _) in zip(hist, SEGMENTS)]
    flat = [torch.cat(parts, dim=1) for parts in zip(*steps)]
    init = [ref_state([x[:, :c] for x in h]) if c else None for h, (c, _, _) in zip(hist, SEGMENTS)]
    tokens, want, start = [], [], 0
    for h, (c, n, offs) in zip(hist, SEGMENTS):
        for off in offs:
            tokens.append(start + off)
            want.append(ref_state([x[:, :c + off + 1] for x in h]))
        start += n
    meta = dict(cu_seqlens_host=torch.tensor([0, *torch.tensor([n for _, n, _ in SEGMENTS])
                                              .cumsum(0).tolist()]),
                cache_lens_host=torch.tensor([c for c, _, _ in SEGMENTS]),
                slot_idx=torch.tensor([3, 0, 2, 1]), seg_kind_host=torch.zeros(4, dtype=torch.long),
                ckpt_tokens_host=torch.tensor(tokens),
                ckpt_slots=torch.tensor(list(range(len(tokens))))[torch.randperm(len(tokens))])
    return flat, init, meta, want


def _run(op, flat, init, meta, want, state_shape, extra, dtype=torch.float32):
    state = torch.full((4, *state_shape), float("nan"), dtype=dtype)
    for slot, st in zip(meta["slot_idx"].tolist(), init):
        if st is not None:
            state[slot] = st.to(dtype)
    ckpt = torch.full((len(want), *state_shape), float("nan"), dtype=dtype)
    op(*flat[:extra[0]], *extra[1], state, None, **meta, ckpt=ckpt, **extra[2])
    for i, slot in enumerate(meta["ckpt_slots"].tolist()):
        torch.testing.assert_close(ckpt[slot].float(), want[i].float(), rtol=1e-4, atol=1e-5,
                                   msg=f"checkpoint {i}")


def test_conv_checkpoints_equal_ref():
    c, w = 6, 4
    wt, bias = torch.randn(c, w), torch.randn(c)

    def ref_state(xs):
        return causal_conv1d_ref(xs[0], wt, bias)[1][0]

    flat, init, meta, want = _batch(lambda t: [torch.randn(1, t, c)], ref_state)
    _run(cached_causal_conv1d, flat, init, meta, want, (c, w - 1), (1, (wt, bias), {}))


def test_ssm_checkpoints_equal_ref():
    h, p, g, n = 4, 3, 2, 5
    A, D, dtb = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h) * 0.1

    def make(t):
        return [torch.randn(1, t, h, p), torch.randn(1, t, h), torch.randn(1, t, g, n),
                torch.randn(1, t, g, n)]

    def ref_state(xs):
        x, dt, B, C = xs
        return ssm_scan_ref(x, dt, A, B, C, D, dtb, 0.0, float("inf"), CHUNK)[1][0]

    flat, init, meta, want = _batch(make, ref_state)
    x, dt, B, C = flat

    def op(state, spec, **kw):
        return cached_ssm_scan(x, dt, A, B, C, D, dtb, state, spec, dt_min=0.0,
                               dt_max=float("inf"), chunk_size=CHUNK, **kw)

    _run(op, flat, init, meta, want, (h, p, n), (0, (), {}))


@pytest.mark.parametrize("chunk", [CHUNK, 64])
def test_gdn_checkpoints_equal_ref(chunk):
    hk, dk, dv = 2, 4, 3

    def make(t):
        return [torch.randn(1, t, hk, dk), torch.randn(1, t, hk, dk), torch.randn(1, t, hk, dv),
                -torch.rand(1, t, hk), torch.rand(1, t, hk)]

    def ref_state(xs):
        return gated_delta_rule_ref(*xs, use_qk_l2norm=True)[1][0]

    flat, init, meta, want = _batch(make, ref_state)
    _run(cached_gated_delta_rule, flat, init, meta, want, (hk, dk, dv),
         (5, (), dict(use_qk_l2norm=True, scale=0.0, chunk_size=chunk)))
