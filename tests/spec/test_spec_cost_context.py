"""The cost model prices a step at its context (engine/spec_cost.py `MeasuredCost`): a step's
attention reads every cached key of its sequences, so steps observed at different contexts
must not teach their row counts that context's cost. Also the drafter's cost table (non-
decreasing) and the probe gap near break-even. Oracles: exact arithmetic on synthetic costs
that are linear in the context."""
from __future__ import annotations

import pytest

from specdeploy.engine.spec_control import MAX_PROBE_GAP, NEAR_EVEN, CostController
from specdeploy.engine.spec_cost import REG_MIN, MeasuredCost
from tests.spec.cost_models import Linear, _Seq

NET = {1: 3e-3, 2: 3.3e-3, 3: 3.7e-3, 4: 4.0e-3}  # a step's cost at no context, by rows
COEF = 2e-6  # seconds per cached key


def _true(rows: int, keys: float) -> float:
    return NET[rows] + COEF * keys


def test_context_slope_is_learnt_and_row_counts_are_priced_net_of_it():
    """1-row steps over contexts 16..400 give the slope; 2-row steps seen only at long
    contexts (as a request's first drafts often are) then price an extra row at its own cost,
    not at that context's; the planned step's context is added back for every row count."""
    m = MeasuredCost(dict(NET), {}, alpha=0.5)
    keys = [16 + (i * 37) % 385 for i in range(3 * REG_MIN)]
    for i, k in enumerate(keys):
        m.observe(1, _true(1, k), k)
        if i >= REG_MIN + 4:  # once the slope is known
            m.observe(2, _true(2, 350 + i % 50), 350 + i % 50)
    assert m.ctx_coef == pytest.approx(COEF, rel=1e-6)
    for ctx in (0.0, 120.0, 900.0):
        m.context = ctx
        assert m.target_s(1) == pytest.approx(_true(1, ctx), rel=1e-6)
        assert m.target_s(2) == pytest.approx(_true(2, ctx), rel=1e-6)
        assert m.target_s(2) - m.target_s(1) == pytest.approx(NET[2] - NET[1], rel=1e-4)
    # without the context (the model before): the extra row priced at 350-400 keys' cost
    old = MeasuredCost(dict(NET), {}, alpha=0.5)
    for i, k in enumerate(keys):
        old.observe(1, _true(1, k))
        if i >= REG_MIN + 4:
            old.observe(2, _true(2, 350 + i % 50))
    assert old.target_s(2) - old.target_s(1) > 2 * (NET[2] - NET[1])


def test_the_slope_waits_for_a_spread_of_contexts_and_is_never_negative():
    m = MeasuredCost(dict(NET), {}, alpha=0.5)
    for _ in range(4 * REG_MIN):  # one context only: no slope
        m.observe(1, _true(1, 200), 200)
    assert m.ctx_coef == 0.0
    n = MeasuredCost(dict(NET), {}, alpha=0.5)
    for i in range(4 * REG_MIN):  # cheaper at longer contexts (drift): 0, not negative
        k = 16 + (i * 37) % 385
        n.observe(1, 5e-3 - 1e-6 * k, k)
    assert n.ctx_coef == 0.0
    few = MeasuredCost(dict(NET), {}, alpha=0.5)
    for i in range(REG_MIN - 1):  # too few steps yet
        k = 16 + (i * 37) % 385
        few.observe(1, _true(1, k), k)
    assert few.ctx_coef == 0.0


def test_the_controller_passes_contexts_to_models_that_take_them():
    got = []

    class TwoArgs(Linear):  # a cost model whose observe predates contexts
        def observe(self, rows, seconds):
            got.append((rows, seconds))

    CostController(TwoArgs(1.0, 0.1, 0.1), 3, 3).observe_step(2, 0.5, 300)
    assert got == [(2, 0.5)]
    CostController(Linear(1.0, 0.1, 0.1), 3, 3).observe_step(2, 0.5, 300)  # no observe: fine
    m = MeasuredCost(dict(NET), {})
    c = CostController(m, 3, 3)
    c.set_context(250)
    assert m.context == 250


def test_draft_costs_never_fall_with_rows():
    m = MeasuredCost({1: 1.0}, {1: 0.3, 2: 0.5, 4: 0.4, 8: 0.45, 16: 0.7})
    assert [m.draft_s(r) for r in (1, 2, 3, 4, 8, 12, 16)] == pytest.approx(
        [0.3, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7], rel=1e-12)


def test_a_rejected_probe_near_break_even_keeps_the_gap_short():
    """Costs: a target step 1 + 0.1 a row, a drafter forward 0.1. One draft at acceptance a
    makes (1 + a) / 1.3 tokens a unit of time against plain's 1 / 1.1: within NEAR_EVEN of it
    while a >= 1.3 * NEAR_EVEN / 1.1 - 1. Rejected probes there leave the gap at probe_every;
    once the estimate falls below, each doubles it."""
    c = CostController(Linear(1.0, 0.1, 0.1), 3, 3, probe_every=2, prior=0.5, alpha=0.2)
    s = _Seq()
    c.state(s)
    threshold = 1.3 * NEAR_EVEN / 1.1 - 1
    gaps, accs = [], []
    for _ in range(20):
        c.observe(s, 0, 1, False)
        gaps.append(s.spec.control.gap)
        accs.append(s.spec.control.model[0])
    near = [a >= threshold for a in accs]
    assert any(near) and not all(near)
    first_far = near.index(False)
    assert all(g == 2 for g in gaps[:first_far])
    assert gaps[first_far:first_far + 4] == [4, 8, 16, 32]
    assert set(gaps[first_far + 4:]) == {MAX_PROBE_GAP}
