"""The C row kernels (RMSNorm, RoPE) against the torch formulas they replace."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import row_kernels as rk
from specdeploy.ops import state_rows as sr
from specdeploy.ops.norm import _rms_norm_kernel, rms_norm_ref
from specdeploy.ops.rope import _rope_kernel, rope_ref, rotate_half

pytestmark = pytest.mark.skipif(rk._library() is None, reason="no C compiler here")


@pytest.mark.parametrize("t", [1, 2, 5, 17, 70])
@pytest.mark.parametrize("heads,d,rot", [(9, 64, 64), (3, 24, 24), (2, 40, 16)])
def test_rope_bit_identical_to_torch(t, heads, d, rot):
    g = torch.Generator().manual_seed(t * 7 + d)
    # q as the model sees it: a strided slice of a fused qkv output
    qkv = torch.randn(1, t, 3 * heads * d, generator=g)
    x = qkv[..., heads * d: 2 * heads * d].unflatten(-1, (heads, d))
    cos, sin = torch.randn(1, t, rot, generator=g), torch.randn(1, t, rot, generator=g)
    out = rk.rope(x, cos, sin)
    assert out is not None
    if rot == d:  # the torch kernel's own formula, rounding for rounding
        want = x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]
    else:
        want = rope_ref(x, cos, sin)
    assert torch.equal(out, want)
    assert torch.equal(_rope_kernel(x, cos, sin), want)


@pytest.mark.parametrize("t", [1, 3, 16, 65])
@pytest.mark.parametrize("n", [7, 64, 576, 1001])
def test_rms_norm_matches_ref_and_is_batch_invariant(t, n):
    g = torch.Generator().manual_seed(t + n)
    x = torch.randn(1, t, n, generator=g) * 3
    w = torch.randn(n, generator=g)
    out = rk.rms_norm(x, w, 1e-6)
    want = rms_norm_ref(x.double(), w.double(), 1e-6)
    # fp32 sums of n squares: a few ulps from the fp64 value
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    for i in range(t):  # each row alone gives the same bits (decode row vs verify row)
        assert torch.equal(rk.rms_norm(x[:, i:i + 1], w, 1e-6), out[:, i:i + 1])
    strided = torch.randn(1, t, 2 * n, generator=g)[..., :n]
    torch.testing.assert_close(rk.rms_norm(strided, w, 1e-6), rms_norm_ref(strided, w, 1e-6),
                               rtol=1e-6, atol=1e-6)


def test_not_taken_where_torch_must_run():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert rk.rms_norm(x.double(), w.double(), 1e-6) is None  # fp64
    assert rk.rms_norm(x, torch.randn(4), 1e-6) is None  # weight of another size
    xg = x.clone().requires_grad_(True)
    assert rk.rms_norm(xg, w, 1e-6) is None  # training: autograd goes through torch
    out = _rms_norm_kernel(xg, w, 1e-6)
    out.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    q = torch.randn(1, 2, 3, 8)
    assert rk.rope(q, torch.randn(1, 2, 6), torch.randn(1, 2, 6)) is not None
    assert rk.rope(q, torch.randn(1, 2, 5), torch.randn(1, 2, 5)) is None  # odd rotary dims
    assert rk.rope(q, torch.randn(1, 1, 8), torch.randn(1, 1, 8)) is None  # broadcast cos


@pytest.mark.parametrize("rows", [1, 4, 70])
def test_every_simd_clone_gives_the_generic_bits(rows):
    """RMSNorm, add + RMSNorm and SiLU-mul run AVX2 / AVX-512 clones of their C where the CPU
    has them (row_kernels.c): the same operations in the same order, so the generic C's bits
    (a fused multiply-add or a reordered sum would show here). Odd widths: the vector tails."""
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 1003, generator=g) * 3, torch.randn(rows, 1003, generator=g)
    w = torch.randn(1003, generator=g)
    gu = torch.randn(rows, 2 * 771, generator=g) * 4
    gu[0, :8] = torch.tensor([-100.0, -88.0, -87.5, 0.0, -0.0, 30.0, 1e-30, -1e-30])

    def run():
        return (rk.rms_norm(x, w, 1e-6), *rk.add_rms_norm(x, b, w, 1e-6), rk.silu_mul(gu, 771))

    with rk.max_isa(0):
        want = run()
    for level in (1, 2):
        with rk.max_isa(level):
            got = run()
        for a, e in zip(got, want):
            assert torch.equal(a, e), level
    torch.testing.assert_close(want[3], torch.nn.functional.silu(gu[:, :771]) * gu[:, 771:],
                               rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("with_state", [True, False])
def test_conv_step_matches_the_reference_and_is_batch_invariant(activation, with_state):
    """A conv1d decode step (conv_step_rows) against causal_conv1d_ref (fp32 sums of 4 terms in
    another order: 1e-6), and each row alone the same bits as in the batch."""
    from specdeploy.ops.conv import causal_conv1d_ref

    g = torch.Generator().manual_seed(3)
    b, c, w = 5, 72, 4
    x, weight, bias = (torch.randn(b, 1, c, generator=g), torch.randn(c, w, generator=g),
                       torch.randn(c, generator=g))
    state = torch.randn(b, c, w - 1, generator=g) if with_state else None
    y, new = sr.conv_step(x, weight, bias, state, activation)
    want_y, want_state = causal_conv1d_ref(x, weight, bias, state, activation)
    torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6)
    assert torch.equal(new, want_state)  # a shift: exact
    for r in range(b):
        y1, _ = sr.conv_step(x[r:r + 1], weight, bias, None if state is None else state[r:r + 1],
                             activation)
        assert torch.equal(y1[0], y[r])
    assert sr.conv_step(x, weight, bias, state, "gelu") is None  # not taken: torch runs it


@pytest.mark.parametrize("with_state", [True, False])
def test_ssm_step_matches_the_torch_step_and_is_batch_invariant(with_state):
    """Mamba2's decode step in C (ssm_step_rows) against ssm_scan_ref over one token (fp32 sums
    of N products in another order: 1e-5), each row alone the same bits as in the batch."""
    from specdeploy.ops.ssm import ssm_scan_ref

    g = torch.Generator().manual_seed(4)
    r, h, p, n, grp = 3, 4, 8, 16, 2
    x, dt = torch.randn(r, 1, h, p, generator=g), torch.randn(r, 1, h, generator=g)
    A, D = -torch.rand(h, generator=g) * 4 - 1, torch.randn(h, generator=g)
    B, C = torch.randn(r, 1, grp, n, generator=g), torch.randn(r, 1, grp, n, generator=g)
    dt_bias = torch.randn(h, generator=g)
    state = torch.randn(r, h, p, n, generator=g) if with_state else None
    from specdeploy.ops.ssm import ssm_dt
    delta = ssm_dt(dt, dt_bias, 0.0, float("inf"))
    y, new = sr.ssm_step(x[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], D, state)
    want_y, want_state = ssm_scan_ref(x, dt, A, B, C, D, dt_bias, 0.0, float("inf"),
                                      initial_state=state)
    torch.testing.assert_close(y, want_y[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, want_state, rtol=1e-5, atol=1e-5)
    for i in range(r):
        y1, s1 = sr.ssm_step(x[i:i + 1, 0], delta[i:i + 1, 0], A, B[i:i + 1, 0], C[i:i + 1, 0],
                             D, None if state is None else state[i:i + 1])
        assert torch.equal(y1[0], y[i]) and torch.equal(s1[0], new[i])


@pytest.mark.parametrize("with_state", [True, False])
def test_gdn_step_matches_the_reference_and_is_batch_invariant(with_state):
    """The gated delta rule's decode step in C (gdn_step_rows) against gated_delta_rule_ref
    over one token (1e-5), each row alone the same bits as in the batch."""
    from specdeploy.ops.gdn import _prepare, gated_delta_rule_ref

    g = torch.Generator().manual_seed(5)
    r, h, dk, dv = 3, 4, 16, 8
    q, k = torch.randn(r, 1, h, dk, generator=g), torch.randn(r, 1, h, dk, generator=g)
    v = torch.randn(r, 1, h, dv, generator=g)
    gate, beta = -torch.rand(r, 1, h, generator=g), torch.rand(r, 1, h, generator=g)
    state = torch.randn(r, h, dk, dv, generator=g) if with_state else None
    qf, kf, vf, gf, bf = _prepare(q, k, v, gate, beta, True, dk ** -0.5)
    o, new = sr.gdn_step(qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], gf[:, :, 0], bf[:, :, 0], state)
    want_o, want_state = gated_delta_rule_ref(q, k, v, gate, beta, state, True, dk ** -0.5)
    torch.testing.assert_close(o, want_o[:, 0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, want_state.float(), rtol=1e-5, atol=1e-5)
    for i in range(r):
        o1, s1 = sr.gdn_step(qf[i:i + 1, :, 0], kf[i:i + 1, :, 0], vf[i:i + 1, :, 0],
                             gf[i:i + 1, :, 0], bf[i:i + 1, :, 0],
                             None if state is None else state[i:i + 1])
        assert torch.equal(o1[0], o[i]) and torch.equal(s1[0], new[i])


def _step_cases(g):
    """(name, call(state, slots) -> (y, next state), state [R, ...]) for the three steps."""
    from specdeploy.ops.gdn import _prepare
    from specdeploy.ops.ssm import ssm_dt

    r = 3
    x, weight, bias = (torch.randn(r, 1, 40, generator=g), torch.randn(40, 4, generator=g),
                       torch.randn(40, generator=g))
    h, p, n, grp = 4, 8, 21, 2  # n not a multiple of 8: the sum's lane tail
    xs, dt = torch.randn(r, h, p, generator=g), torch.randn(r, h, generator=g)
    A, D = -torch.rand(h, generator=g) * 4 - 1, torch.randn(h, generator=g)
    B, C = torch.randn(r, grp, n, generator=g), torch.randn(r, grp, n, generator=g)
    delta = ssm_dt(dt, torch.randn(h, generator=g), 0.0, float("inf"))
    q, k = torch.randn(r, 1, h, 16, generator=g), torch.randn(r, 1, h, 16, generator=g)
    v = torch.randn(r, 1, h, 13, generator=g)
    gate, beta = -torch.rand(r, 1, h, generator=g), torch.rand(r, 1, h, generator=g)
    qf, kf, vf, gf, bf = (t[:, :, 0] for t in _prepare(q, k, v, gate, beta, True, 0.25))
    return [
        ("conv", lambda s, sl: sr.conv_step(x, weight, bias, s, "silu", sl),
         torch.randn(r, 40, 3, generator=g)),
        ("ssm", lambda s, sl: sr.ssm_step(xs, delta, A, B, C, D, s, sl),
         torch.randn(r, h, p, n, generator=g)),
        ("gdn", lambda s, sl: sr.gdn_step(qf, kf, vf, gf, bf, s, sl),
         torch.randn(r, h, 16, 13, generator=g)),
    ]


def test_steps_in_place_on_slots_give_the_copy_forms_bits():
    """With `slots`, a step reads and writes the cache's rows in place: the same y and next
    state bits as the copy form on the gathered rows; rows outside `slots` untouched."""
    g = torch.Generator().manual_seed(6)
    for name, call, state in _step_cases(g):
        y, new = call(state, None)
        cache = torch.full((7, *state.shape[1:]), float("nan"))
        slots = torch.tensor([5, 1, 3])
        cache[slots] = state
        y2, new2 = call(cache, slots)
        assert new2 is cache, name
        assert torch.equal(y2, y) and torch.equal(cache[slots], new), name
        assert torch.isnan(cache[[0, 2, 4, 6]]).all(), name
        assert call(cache, slots.int()) is None, name  # int32 slots: not taken
        assert call(cache[:, None], slots) is None, name  # wrong state shape


def test_step_and_gated_norm_clones_give_the_generic_bits():
    """The SSM / gated-delta steps and the gated RMSNorm run AVX2 / AVX-512 clones of their C
    where the CPU has them: the generic C's bits (a fused multiply-add or a reordered sum would
    show here)."""
    g = torch.Generator().manual_seed(8)
    cases = _step_cases(g)
    x, gate = torch.randn(5, 2 * 77, generator=g) * 3, torch.randn(5, 2 * 77, generator=g) * 4
    w = torch.randn(2 * 77, generator=g)

    def run():
        out = [t for _, call, state in cases for t in call(state, None)]
        return out + [rk.gated_rms_norm(x, gate, w, 1e-6, 77, nbg) for nbg in (False, True)]

    with rk.max_isa(0):
        want = run()
    for level in (1, 2):
        with rk.max_isa(level):
            got = run()
        for a, e in zip(got, want):
            assert torch.equal(a, e), level


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_matches_the_reference_and_is_batch_invariant(norm_before_gate):
    """The gated RMSNorm in C against gated_rms_norm_ref (fp32 sums of 64 squares in another
    order: 1e-5), strided rows (a split's view) read in place, each row alone the same bits."""
    from specdeploy.ops.norm import gated_rms_norm_ref

    g = torch.Generator().manual_seed(9)
    both = torch.randn(1, 6, 3 * 128, generator=g) * 2
    x, gate = both[..., :256], both[..., 256:].repeat(1, 1, 2) * 3
    w = torch.randn(256, generator=g)
    out = rk.gated_rms_norm(x, gate, w, 1e-5, 64, norm_before_gate)
    want = gated_rms_norm_ref(x, gate, w, 1e-5, 64, norm_before_gate)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for i in range(6):
        one = rk.gated_rms_norm(x[:, i:i + 1], gate[:, i:i + 1], w, 1e-5, 64, norm_before_gate)
        assert torch.equal(one[0, 0], out[0, i])
    assert rk.gated_rms_norm(x, gate, w, 1e-5, 60, norm_before_gate) is None  # 256 % 60


@pytest.mark.parametrize("with_state", [True, False])
def test_gdn_step_normalizes_and_shares_heads_itself(with_state):
    """The step on raw q / k (l2norm and scale in the C, each q / k head serving two value
    heads) against gated_delta_rule_ref over one token (1e-5); the core's one-token form is
    that call (its bits)."""
    from specdeploy.ops.gdn import gated_delta_rule_core, gated_delta_rule_ref

    g = torch.Generator().manual_seed(10)
    r, hk, h, dk, dv = 3, 2, 4, 20, 8
    q, k = torch.randn(r, 1, hk, dk, generator=g), torch.randn(r, 1, hk, dk, generator=g)
    v = torch.randn(r, 1, h, dv, generator=g)
    gate, beta = -torch.rand(r, 1, h, generator=g), torch.rand(r, 1, h, generator=g)
    state = torch.randn(r, h, dk, dv, generator=g) if with_state else None
    o, new = sr.gdn_step(q[:, 0], k[:, 0], v[:, 0], gate[:, 0], beta[:, 0], state, None, True,
                         0.3)
    want_o, want_state = gated_delta_rule_ref(q, k, v, gate, beta, state, True, 0.3)
    torch.testing.assert_close(o, want_o[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, want_state, rtol=1e-5, atol=1e-5)
    core = gated_delta_rule_core(q, k, v, gate, beta, state, True, 0.3)
    assert torch.equal(core.o[:, 0], o) and torch.equal(core.final_state, new)
    assert sr.gdn_step(q[:, 0], k[:, 0, :1], v[:, 0], gate[:, 0], beta[:, 0], state) is None


def test_promote_states_equals_advanced_indexing():
    """A speculative commit's one C call: main[slot] <- spec[slot, idx] for every state pair,
    as the indexing it replaces (fp32 and bf16 states, several slots, any order)."""
    g = torch.Generator().manual_seed(5)
    pairs = [(torch.randn(5, 8, 6, generator=g), torch.randn(5, 4, 8, 6, generator=g)),
             (torch.randn(5, 7, generator=g).to(torch.bfloat16),
              torch.randn(5, 4, 7, generator=g).to(torch.bfloat16))]
    slots, idx = [3, 0, 4], [2, 0, 3]
    want = [m.clone() for m, _ in pairs]
    for w, (_, sp) in zip(want, pairs):
        w[torch.tensor(slots)] = sp[torch.tensor(slots), torch.tensor(idx)]
    assert sr.promote_states(pairs, slots, idx)
    for w, (m, _) in zip(want, pairs):
        assert torch.equal(m, w)
    with pytest.raises(IndexError, match="slots"):
        sr.promote_states(pairs, [5], [0])
    with pytest.raises(IndexError, match="indices"):
        sr.promote_states(pairs, [0], [4])
    # what the call cannot take is left to the caller (False, nothing written)
    odd = [(torch.zeros(5, 6, 8).transpose(1, 2), torch.ones(5, 4, 8, 6))]
    assert not sr.promote_states(odd, [0], [0]) and not odd[0][0].any()
    assert not sr.promote_states([(torch.zeros(5, 3), torch.ones(5, 4, 2))], [0], [0])


@pytest.mark.parametrize("threads", [1, 2])
def test_promote_states_large_on_threads_and_cached(threads):
    """Commits of more than 256 KB copy on the threads (hybrid-demo's: 8 pairs, ~0.56 MB a
    row): the same as indexing, through one `StatePromoter` reused step after step."""
    g = torch.Generator().manual_seed(6)
    pairs = [(torch.randn(4, 8, 64, 68, generator=g), torch.randn(4, 3, 8, 64, 68, generator=g))
             for _ in range(3)] + [(torch.randn(4, 510, 4, generator=g),
                                    torch.randn(4, 3, 510, 4, generator=g))]
    promote = sr.StatePromoter(pairs)
    assert promote.usable
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for slots, idx in (([2], [1]), ([0, 3, 1], [2, 0, 1]), ([3], [2])):
            want = [m.clone() for m, _ in pairs]
            for w, (_, sp) in zip(want, pairs):
                w[torch.tensor(slots)] = sp[torch.tensor(slots), torch.tensor(idx)]
            assert promote(slots, idx)
            for w, (m, _) in zip(want, pairs):
                assert torch.equal(m, w)
            for _, sp in pairs:  # the next step's verify writes new spec entries
                sp.add_(1.0)
    finally:
        torch.set_num_threads(before)
