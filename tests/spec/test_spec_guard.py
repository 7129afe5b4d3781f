"""The controller's realized-rate guard (engine/spec_control.py `observe_rate`, `guarded`): where
steps that verified drafts made fewer tokens per second than plain steps at the same batch size,
drafting stops there but for one explored step in EXPLORE_EVERY. Oracles: exact arithmetic on
the EMAs, the non-speculative output, and the steps the engine ran."""
from __future__ import annotations

import pytest

from specdeploy import SamplingParams
from specdeploy.engine.lookup import Lookup
from specdeploy.engine.spec_control import (
    EXPLORE_EVERY,
    GUARD_ALPHA,
    GUARD_MIN,
    GUARD_TOL,
    IDLE_CUTS,
    CostController,
    MeasuredCost,
)
from tests.spec.test_spec_controller import (  # noqa: F401
    FREE,
    MAX_TOKENS,
    Linear,
    _controlled,
    _ids,
    baseline,
)


def _fed(plain: float, drafting: float, n: int = GUARD_MIN, batch: int = 4) -> CostController:
    c = CostController(FREE, 3, 3)
    for _ in range(n):
        c.observe_rate(batch, batch, batch / plain, False)  # a plain step: one token a sequence
        c.observe_rate(batch, 2 * batch, 2 * batch / drafting, True)
    return c


def test_rates_are_emas_per_batch_size():
    c = CostController(FREE, 3, 3)
    c.observe_rate(4, 4, 0.04, False)  # the first: itself (100 tokens/s)
    c.observe_rate(4, 4, 0.02, False)  # then an EMA: 100 + alpha * (200 - 100)
    c.observe_rate(4, 6, 0.05, True)  # drafting: 120 tokens/s
    c.observe_rate(1, 2, 0.01, True)  # another batch size: its own
    assert c._rates[4] == pytest.approx([100 + GUARD_ALPHA * 100, 2, 120.0, 1], rel=1e-12)
    assert c._rates[1] == [0.0, 0, 200.0, 1]
    for bad in ((0, 1, 0.1), (4, 1, 0.0), (4, 1, float("nan"))):
        c.observe_rate(*bad, True)
    assert c._rates[4][3] == 1 and 0 not in c._rates


def test_guard_engages_only_when_drafting_lost_and_explores():
    lost = _fed(100.0, 100.0 * (1 - GUARD_TOL) - 1.0)
    # one step in EXPLORE_EVERY drafts as the model says
    assert [lost.guarded(4) for _ in range(2 * EXPLORE_EVERY)] == (
        [True] * (EXPLORE_EVERY - 1) + [False]) * 2
    assert not lost.guarded(1)  # nothing measured at another batch size
    even = _fed(100.0, 100.0 * (1 - GUARD_TOL) + 0.5)  # within the tolerance: drafting goes on
    assert not any(even.guarded(4) for _ in range(EXPLORE_EVERY))
    few = _fed(100.0, 10.0, n=GUARD_MIN - 1)  # too few steps of each yet
    assert not few.guarded(4)
    won = _fed(100.0, 150.0)
    assert not won.guarded(4)


class _Seq:
    def __init__(self):
        class spec:
            control = None
            drafts = ()
            from_lookup = False
        self.spec = spec


def test_idle_cuts_pause_lookups_only_where_an_even_bet_cannot_pay():
    """16 sequences whose cuts keep nothing, IDLE_CUTS times in a row: where a verify row costs
    more than an even bet wins (break-even 16 * 0.1 / 2.6 = 0.62) the next steps look nothing
    up but one in EXPLORE_EVERY; a cut that keeps a draft ends it. Where a row costs 5% (break-
    even 0.44) lookups go on every step."""
    dear = CostController(Linear(1.0, 0.1, 0.25), 3, 6, drafter=False)
    seqs = [_Seq() for _ in range(16)]
    for _ in range(IDLE_CUTS):
        assert not dear.guarded(16)
        dear.cut(seqs)
    assert [dear.guarded(16) for _ in range(EXPLORE_EVERY)] == [True] * (EXPLORE_EVERY - 1) + [
        False]
    assert not dear.guarded(8)  # another batch size than the cuts'
    seqs[3].spec.drafts = [7]  # an explored step kept a draft (a drafter's: not lookup)
    dear.cut(seqs)
    assert not dear.guarded(16)
    cheap = CostController(Linear(1.0, 0.05, 0.25), 3, 6, drafter=False)
    seqs[3].spec.drafts = ()
    for _ in range(2 * IDLE_CUTS):
        cheap.cut(seqs)
    assert not any(cheap.guarded(16) for _ in range(EXPLORE_EVERY))


@pytest.mark.parametrize("lookup", [None, (3, 1)])
def test_guarded_engine_drafts_rarely_and_stays_lossless(target, baseline, lookup,  # noqa: F811
                                                          monkeypatch):
    """Drafts that cost nothing (the controller alone would draft K every step), but drafting
    measured far below plain at every batch size: the engine drafts in about one step in
    EXPLORE_EVERY, looks nothing up in the others, and its greedy output is plain's."""
    paused = []
    complete = Lookup.complete
    monkeypatch.setattr(Lookup, "complete", lambda self, *a: (paused.append(self.paused),
                                                               complete(self, *a))[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    free = _controlled(target, CostController(FREE, 3, 3, probe_every=0), lookup)
    try:
        assert _ids(free.generate(target.prompts, params)) == baseline
        unguarded = free.stats()["draft_steps"]
    finally:
        free.engine.set_controller(None)
    ctl = CostController(FREE, 3, 3, probe_every=0)
    for b in range(1, 9):  # plain: 1e12 tokens/s, drafting: 1
        ctl._rates[b] = [1e12, 100, 1.0, 100]
    llm = _controlled(target, ctl, lookup)
    paused.clear()
    try:
        assert _ids(llm.generate(target.prompts, params)) == baseline
        s = llm.stats()
        assert 0 < s["draft_steps"] < unguarded / 3
        if lookup is not None:  # looked up only in the explored steps
            assert paused.count(True) > 3 * paused.count(False) > 0
    finally:
        llm.engine.set_controller(None)
        llm.engine.set_lookup(None)


def test_break_even_reads_the_calibration_table():
    """A learnt model that saw a 17-row step cheaper than the 16-row ones (early in a wave)
    prices the 17th row at nothing; the break-even acceptance comes from the table, where
    every row count was timed alike: 16 * (13 / 12 - 1)."""
    m = MeasuredCost({16: 12.0, 17: 13.0, 32: 21.0}, {}, alpha=0.5)
    for rows, s in ((16, 9.0), (16, 18.0), (17, 9.0), (17, 15.0)):
        m.observe(rows, s)  # (the first at each row count: a warm-up)
    assert m.target_s(17) == m.target_s(16)
    c = CostController(m, 3, 6, drafter=False)
    assert c.break_even(16) == pytest.approx(16 * (13.0 / 12.0 - 1), rel=1e-12)
