"""What the speculation controller learns (engine/spec_control.py): acceptance estimates per
draft position from the verifies (per sequence and global), the lookup hold table per copy
length, measured costs, and the drafting phase's overhead per chain length."""
from __future__ import annotations

import pytest

from specdeploy.engine.spec_accept import (
    COPY_BUCKETS,
    LOOKUP_HOLD_PRIOR,
    copy_bucket,
    store_bucket,
)
from specdeploy.engine.spec_control import CostController
from specdeploy.engine.spec_cost import MeasuredCost
from tests.spec.cost_models import FREE, Linear, _Seq


def test_acceptance_estimates_follow_the_verifies():
    class Seq:
        class spec:
            control = None
    c = CostController(FREE, 3, 3, alpha=0.5, prior=0.5)
    s = Seq()
    hold = list(c.hold)
    c.observe(s, 1, 3, False)  # position 1 accepted, position 2 rejected, 3 not seen
    # position 3, which no verify has reached, follows position 2 (not the prior)
    assert s.spec.control.model == [0.75, 0.25, 0.25]
    assert c.hold == hold  # drafter verifies leave the lookup table alone


def test_unreached_positions_follow_the_last_reached_one():
    """Drafts past the first are planned only where their estimate pays: positions no verify
    has reached take the estimate before them (globally and per sequence), so a first-draft
    acceptance above the prior opens the next positions to a test; once reached, each learns
    on its own."""
    c = CostController(FREE, 3, 3, alpha=0.5, prior=0.5)
    s = _Seq()
    c.observe(s, 1, 1, False)  # one draft, accepted: position 1 only
    assert s.spec.control.model == [0.75, 0.75, 0.75]
    assert c.glob["model"][1:] == [c.glob["model"][0]] * 2
    first = _Seq()  # a new sequence starts from the global estimates
    assert c.state(first).model == c.glob["model"]
    c.observe(s, 0, 2, False)  # two drafts, the first rejected: position 2 still unreached
    assert s.spec.control.model == [0.375, 0.375, 0.375]
    c.observe(s, 2, 2, False)  # both accepted: position 2 reached; 3 follows it
    assert s.spec.control.model == [0.6875, 0.6875, 0.6875]
    c.observe(s, 0, 1, False)  # position 2 learns only from verifies that reach it
    assert s.spec.control.model == [0.34375, 0.6875, 0.6875]


def test_copy_buckets_and_lookup_acceptance():
    assert [copy_bucket(m) for m in (0, 1, 2, 3, 5, 6, 63, 64, 500)] == [
        0, 0, 1, 2, 3, 4, 10, 11, 11]
    assert len(LOOKUP_HOLD_PRIOR) == len(COPY_BUCKETS) + 1
    # a bound itself opens the next bucket; NaN (no estimate) counts as the top one
    assert [store_bucket(c) for c in (-1.0, 0.0, 0.1999, 0.2, 0.55, 0.9, 1.0, float("nan"))] \
        == [0, 0, 0, 1, 4, 8, 8, 8]
    c = CostController(FREE, 3, 16)
    # a match that copied 3 tokens: its drafts are the 4th, 5th, ... tokens of the copy
    assert c.lookup_acc(3, 4) == [LOOKUP_HOLD_PRIOR[copy_bucket(m)] for m in (3, 4, 5, 6)]


def test_lookup_verifies_teach_the_hold_table():
    c = CostController(FREE, 3, 16, alpha_lookup=0.5, hold=(0.5,) * 12)
    s = _Seq(copied=5)  # drafts at copy lengths 5, 6, 7, 8, ... : buckets 3, 4, 4, 5
    c.observe(s, 2, 6, True)  # two accepted, the third rejected, the rest not seen
    want = [0.5] * 12
    want[3] = 0.75  # m=5 held
    want[4] = 0.5 + 0.5 * (1 - 0.5)  # m=6 held: 0.75 ...
    want[4] += 0.5 * (0.0 - want[4])  # ... then m=7 did not: 0.375
    assert c.hold == want
    assert s.spec.control.model == [0.6] * 16  # the drafter's estimates untouched


def test_measured_cost_interpolates():
    m = MeasuredCost({1: 1.0, 3: 2.0, 5: 5.0}, {})
    assert [m.target_s(r) for r in (1, 2, 4, 7)] == [1.0, 1.5, 3.5, 8.0]
    assert m.draft_s(4) == 0.0


def test_drafting_overhead_is_learnt():
    """The drafting phase measured at twice the calibrated forwards' time: the modelled
    drafter cost doubles (EMA), so fewer drafts pay; a step without drafter drafts teaches
    nothing."""
    cost = Linear(1.0, 0.1, 0.2)
    c = CostController(cost, 3, 3, alpha=0.5)
    s = _Seq()
    s.spec.limit = 3  # catch-up (2 rows) + 2 chain forwards: 3 x 0.2 modelled
    before = c.step_cost([3])
    assert before == pytest.approx(cost.target_s(4) + 0.6, rel=1e-12)
    for _ in range(30):
        c.observe_draft([s], 1.2)
    assert c.draft_scale == pytest.approx(2.0, rel=1e-6)
    assert c.step_cost([3]) == pytest.approx(cost.target_s(4) + 1.2, rel=1e-6)
    s.spec.limit = 0
    c.observe_draft([s], 5.0)
    assert c.draft_scale == pytest.approx(2.0, rel=1e-6)
    acc = [[0.7, 0.6, 0.5]]
    assert c.allocate(acc, [3]) <= CostController(cost, 3, 3).allocate(acc, [3])


def test_a_sequences_first_verifies_weigh_more():
    """A new sequence starts from the global estimate, which earlier requests set; its own
    first verifies count as evidence beside it (weights 1/3, 1/4, ... of START_WEIGHT + n),
    down to the EMA's alpha: three accepted drafts move 0.4 to 0.76, not 0.56."""
    from specdeploy.engine.spec_control import START_WEIGHT

    assert START_WEIGHT == 2
    c = CostController(FREE, 3, 3, alpha=0.1, prior=0.4)
    s = _Seq()
    want = 0.4
    for n in range(1, 12):
        c.observe(s, 1, 1, False)
        want += max(0.1, 1 / (START_WEIGHT + n)) * (1 - want)
        assert s.spec.control.model[0] == pytest.approx(want, rel=1e-12)
        if n == 3:
            assert want == pytest.approx(0.76)
    assert c.glob["model"][0] < 0.75  # the global estimate keeps its slow EMA


def test_drafting_scale_is_learnt_per_chain_length():
    """Phases of one draft measured at 2x their model and of three at 1.2x: each chain length
    keeps its own scale (the per-phase Python weighs less per forward in longer chains), a
    step is priced by its longest chain's, and an untaught length stays at 1.0."""
    cost = Linear(1.0, 0.1, 0.2)
    c = CostController(cost, 3, 3, alpha=0.5)
    s = _Seq()
    for limit, factor in ((1, 2.0), (3, 1.2)):
        s.spec.limit = limit
        modelled = c._draft_s([1] * limit)
        for _ in range(40):
            c.observe_draft([s], factor * modelled)
    assert c.draft_scales == pytest.approx([1.0, 2.0, 1.0, 1.2], rel=1e-6)
    assert c.draft_scale == pytest.approx(1.2, rel=1e-6)  # K's
    for k, scale in ((1, 2.0), (2, 1.0), (3, 1.2)):
        assert c.step_cost([k]) == pytest.approx(
            cost.target_s(1 + k) + scale * c._draft_s([1] * k), rel=1e-9)
    # at a batch, the longest chain's scale prices the whole drafting phase
    assert c.step_cost([1, 3]) == pytest.approx(
        cost.target_s(6) + 1.2 * c._draft_s([2, 1, 1]), rel=1e-9)


def test_host_work_of_verify_steps_is_learnt_apart_and_priced():
    """A step that verifies drafts spends more host time than a plain one (promoting recurrent
    states, more rows to check, more for the draft source: hybrid-demo ~0.44 against ~0.25 ms,
    2026-12-07). It is learnt apart; until a verify step is seen the one estimate prices both.
    Arithmetic on a synthetic cost: target 1 + 0.1 a row, a drafter forward 0.2."""
    c = CostController(Linear(1.0, 0.1, 0.2), 1, 1, alpha=0.5)
    c.observe_overhead(0.2)  # a plain step
    assert c.overhead == pytest.approx(0.1) and c.overhead_verify is None
    assert c.host_s(True) == c.host_s(False) == pytest.approx(0.1)
    # one draft accepted 40%: (1 + 0.4) / (1.2 + 0.1 + 0.2) beats 1 / (1.1 + 0.1)
    assert c.allocate([[0.4]], [1]) == [1]
    assert c.allocate_rows([[0.3]], [1]) == [1]  # a lookup row: 1.3 / 1.3 against 1 / 1.2
    assert c.break_even(1) == pytest.approx(1.3 / 1.2 - 1)
    c.observe_overhead(0.6, verify=True)  # the first verify step counts as it is
    c.observe_overhead(0.4, verify=True)
    assert c.overhead_verify == pytest.approx(0.5) and c.overhead == pytest.approx(0.1)
    assert c.host_s(True) == pytest.approx(0.5) and c.host_s(False) == pytest.approx(0.1)
    # priced right, neither pays: 1.4 / 1.9 and 1.3 / 1.7 against 1 / 1.2
    assert c.allocate([[0.4]], [1]) == [0]
    assert c.allocate_rows([[0.3]], [1]) == [0]
    assert c.break_even(1) == pytest.approx(1.7 / 1.2 - 1)
    assert c.step_ratio([[0.4]], [1]) == pytest.approx(1.4 / 1.9)
    # where others' drafts make the step a verify step anyway, its host work is no reason
    c.fixed_verify = True
    assert c.allocate_rows([[0.3]], [1]) == [1]  # 1.3 / 1.7 against 1 / 1.7
    c.fixed_verify = False
    for bad in (float("nan"), -1.0):  # nothing learnt from a broken measurement
        c.observe_overhead(bad, verify=True)
    assert c.overhead_verify == pytest.approx(0.5)
