"""The controller's cost model learns from the engine's own steps (engine/spec_control.py
`MeasuredCost.observe`): a calibration table that under-prices rows (short contexts, small
batches) is corrected by measured step times, so drafts that the table says pay but the real
steps say cannot are dropped. Oracles: exact arithmetic on the EMA, the allocation of a
controller over the true cost, and the rows each engine step actually ran."""
from __future__ import annotations

import pytest

from specdeploy import SamplingParams
from specdeploy.cache.metadata import SEG_EXTEND
from specdeploy.engine.spec_control import CostController
from specdeploy.engine.spec_cost import MeasuredCost


def test_observe_is_an_ema_and_the_model_goes_through_it():
    m = MeasuredCost({1: 1.0, 4: 2.0, 16: 5.0}, {}, alpha=0.5)
    assert m.target_s(4) == 2.0 and m.target_s(10) == 3.5  # nothing measured: the table
    m.observe(4, 40.0)  # the first step at a row count: a warm-up, dropped
    assert m.seen == {} and m.target_s(4) == 2.0
    m.observe(4, 4.0)  # first measurement: itself; the other rows scaled by its ratio (2)
    assert [m.target_s(r) for r in (1, 4, 10, 16, 20)] == [2.0, 4.0, 7.0, 10.0, 12.0]
    m.observe(4, 2.0)  # EMA: halfway
    assert m.seen[4] == 3.0 and m.target_s(4) == 3.0 and m.target_s(16) == 7.5
    m.observe(4, 30.0)  # an outlier counts as twice the estimate: 3 + 0.5 * (6 - 3)
    assert m.seen[4] == 4.5
    m.observe(4, 1.5)  # ... and back: 4.5 + 0.5 * (2.25 - 4.5)
    assert m.seen[4] == 3.375
    m.observe(10, 1.0)  # warm-up
    m.observe(10, 9.0)  # 1 takes 4's ratio (3.375 / 2), 16 takes 10's (9 / 3.5, the table at 10)
    assert [m.target_s(r) for r in (1, 4, 7, 10)] == [1.6875, 3.375, 6.1875, 9.0]
    assert m.target_s(16) == pytest.approx(5.0 * 9.0 / 3.5, rel=1e-12)
    m.observe(7, 5.0)  # warm-up
    m.observe(7, 1.0)  # a noisy point below its neighbour: the model stays non-decreasing
    assert m.target_s(7) == 3.375 and m.target_s(10) == 9.0
    for bad in ((0, 1.0), (4, 0.0), (4, float("nan")), (4, float("inf"))):
        m.observe(*bad)
    assert m.seen == {4: 3.375, 7: 1.0, 10: 9.0}


def test_known_row_counts_refresh_every_n_observations():
    """`refresh_every` n: a row count seen for the first time prices at once; the EMA of a known
    one moves the model every n-th observation (the EMA itself every time)."""
    m = MeasuredCost({1: 1.0, 4: 2.0}, {}, alpha=0.5, refresh_every=3)
    m.observe(4, 9.0)  # warm-up
    m.observe(4, 4.0)  # new: at once
    assert m.target_s(4) == 4.0
    m.observe(4, 2.0)  # EMA 3.0, the model still 4.0
    assert m.seen[4] == 3.0 and m.target_s(4) == 4.0
    m.observe(1, 9.0)  # warm-up of 1 (not an observation)
    m.observe(4, 2.0)  # EMA 2.5; the second since the refresh
    assert m.seen[4] == 2.5 and m.target_s(4) == 4.0
    m.observe(4, 1.5)  # EMA 2.0, the third: refreshed
    assert m.seen[4] == 2.0 and m.target_s(4) == 2.0 and m.target_s(1) == 1.0
    m.observe(1, 3.0)  # a new row count: at once
    assert m.target_s(1) == 3.0 and m.target_s(4) == 3.0  # (non-decreasing in rows)


def test_learned_costs_stop_drafts_the_table_overprices():
    """Batch 16: the table (marginal row 0.01 of a 1.0 step) lets drafts at acceptance 0.4 pay;
    real steps cost 0.1 a row on top of it at 16..80 rows, where no such draft can pay
    (each extra row costs as much as a plain sequence's token). After the engine reports real
    times the controller verifies none, as a controller over the true costs does."""
    table = {r: 1.0 + 0.01 * r for r in (1, 4, 16, 32, 64, 96)}

    def true_s(rows):
        return 1.0 + 0.1 * rows

    m = MeasuredCost(dict(table), {})
    c = CostController(m, 3, 3, drafter=False)
    accs, cap = [[0.4] * 3] * 16, [3] * 16
    assert sum(c.allocate(accs, cap, draft=False)) > 0  # the table says drafts pay
    for _ in range(30):
        for rows in (16, 20, 32, 48, 64):
            c.observe_step(rows, true_s(rows))
    assert c.allocate(accs, cap, draft=False) == [0] * 16

    class True_:
        def target_s(self, rows):
            return true_s(rows)

        def draft_s(self, rows):
            return 0.0

    assert CostController(True_(), 3, 3, drafter=False).allocate(accs, cap, draft=False) == (
        [0] * 16)
    # cost models without `observe` (synthetic ones) are left alone
    CostController(True_(), 3, 3).observe_step(16, 1.0)


def test_engine_reports_decode_and_verify_steps_only(target):
    """The rows the controller learns from are exactly the engine's decode / verify steps'
    (a prefill step's rows are not: another cost per row)."""
    llm = target.llm(3)
    eng, d = llm.engine, llm.deployed
    m = MeasuredCost({1: 1e-3, 4: 2e-3, 16: 5e-3}, {})
    seen, ran, keys = [], [], []
    learn = m.observe
    m.observe = lambda rows, s, k=0.0: (seen.append(rows), keys.append(k), learn(rows, s, k))[2]
    fwd = d.forward

    def timed_fwd(meta):
        n = eng._captures()
        out = fwd(meta)
        ran.append(meta.num_tokens)
        fresh.append(eng._captures() != n)  # a capture's step teaches nothing
        return out

    fresh = []
    d.forward = timed_fwd
    eng.set_controller(CostController(m, 3, 3))
    eng.reset_prefix_cache()  # the prompt is prefilled whole, not served from the cache
    try:
        prompt = max(target.prompts, key=len)
        assert len(prompt) > 4
        eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        eng.step()  # the prefill
        assert seen == [] and ran == [len(prompt)]
        while eng.has_unfinished():
            eng.step()
        assert seen == [r for r, f in zip(ran[1:], fresh[1:]) if not f]
        assert seen and all(r <= 4 for r in seen)
        # each step's context: the keys its one sequence had cached, growing step by step
        assert keys[0] >= len(prompt) and all(b > a for a, b in zip(keys, keys[1:]))
        # a row count's first step is a warm-up, dropped (`MeasuredCost.observe`): learnt are
        # exactly those the engine ran twice or more (which ones depends on the timings)
        twice = {r for r in seen if seen.count(r) > 1}
        assert set(m.seen) == twice and twice and all(v > 0 for v in m.seen.values())
    finally:
        d.forward = fwd
        eng.set_controller(None)


def test_a_row_count_seen_few_times_keeps_the_tables_shape():
    """`trust_after` n (the engine's: TRUST_AFTER): a row count seen fewer than n times is
    priced by the table scaled to the measured level, not by its own few (maybe one slow)
    steps; from the n-th on, by its EMA."""
    from specdeploy.engine.spec_cost import TRUST_AFTER

    assert TRUST_AFTER == 4
    m = MeasuredCost({1: 1.0, 2: 1.1, 3: 1.2}, {}, alpha=0.5, trust_after=3)
    for _ in range(4):  # warm-up + 3: row 1 trusted at 2.0 (the table's level x2)
        m.observe(1, 2.0)
    m.observe(3, 9.0)  # warm-up
    m.observe(3, 4.8)  # one slow step at 3 rows: not trusted yet
    assert m.target_s(3) == pytest.approx(2.4) and m.target_s(2) == pytest.approx(2.2)
    m.observe(3, 4.8)
    assert m.target_s(3) == pytest.approx(2.4)
    m.observe(3, 4.8)  # the third: its EMA prices it now
    assert m.target_s(3) == pytest.approx(4.8)
    lone = MeasuredCost({1: 1.0, 2: 1.1}, {}, trust_after=3)
    lone.observe(2, 1.0)
    lone.observe(2, 3.3)  # nothing trusted yet: what was seen, as with trust_after 1
    assert lone.target_s(2) == pytest.approx(3.3) and lone.target_s(1) == pytest.approx(3.0)


def test_engine_reports_host_work_of_plain_and_verify_steps_apart(target):
    """Each decode / verify step's host work reaches the controller flagged by whether the step
    verified drafts: exactly its extend segments'."""
    llm = target.llm(3)
    eng = llm.engine
    ctl = CostController(MeasuredCost({1: 1e-3, 4: 2e-3, 16: 5e-3}, {}), 3, 3, probe_every=1)
    flags, verified = [], []
    learn = ctl.observe_overhead
    ctl.observe_overhead = lambda s, verify=False: (flags.append(verify), learn(s, verify))[1]
    timed, stepped, kinds = eng._timed, eng._stepped, []
    eng._timed = lambda segs, rows, s: (kinds.append(any(
        g.kind == SEG_EXTEND for g in segs)), timed(segs, rows, s))[1]

    def learnt(seconds):  # the steps that teach (a graph capture's do not): their kinds
        if eng._step_parts is not None:
            verified.append(kinds[-1])
        stepped(seconds)

    eng._stepped = learnt
    eng.set_controller(ctl)
    eng.reset_prefix_cache()
    try:
        eng.add_request(max(target.prompts, key=len), SamplingParams(max_tokens=24,
                                                                     ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert flags == verified and True in flags and False in flags
        assert ctl.overhead > 0 and ctl.overhead_verify is not None and ctl.overhead_verify > 0
    finally:
        eng._timed, eng._stepped = timed, stepped
        eng.set_controller(None)


def test_the_row_count_seen_most_carries_the_drift_to_the_others():
    """On a shared host every step slows and speeds up together: the row count seen most (1-row
    decode steps at batch 1) moves the others' estimates by its own factor, so a verify row
    count seen rarely keeps its ratio to it instead of the price of the spell it was seen in."""
    m = MeasuredCost({1: 1.0, 2: 1.1}, {}, alpha=0.5)
    for _ in range(5):
        m.observe(1, 2.0)  # (the first: warm-up)
    m.observe(2, 9.0)  # warm-up
    m.observe(2, 2.2)  # rarely seen, 1.1x a decode step
    assert m.seen == {1: 2.0, 2: 2.2}
    m.observe(1, 4.0)  # a slow spell: 1's EMA 2 -> 3, and 2 with it (x 1.5)
    assert m.seen[1] == pytest.approx(3.0) and m.seen[2] == pytest.approx(3.3)
    m.observe(1, 1.5)  # and back: 3 -> 2.25, 2 x 0.75
    assert m.seen[2] == pytest.approx(2.475)
    m.observe(2, 2.475 * 1.2)  # its own step still moves its EMA (and not the others')
    assert m.seen[2] == pytest.approx(2.475 * 1.1) and m.seen[1] == pytest.approx(2.25)
    assert m.target_s(2) / m.target_s(1) == pytest.approx(1.21)


def test_a_step_that_captured_a_graph_teaches_nothing(target):
    """A step whose forward (or drafting) captured a graph took the capture's time, not its
    cost: the controller learns neither its rows' cost nor its host work from it."""
    llm = target.llm(3)
    eng = llm.engine
    ctl = CostController(MeasuredCost({1: 1e-3, 4: 2e-3, 16: 5e-3}, {}), 3, 3, probe_every=1)
    rows, over = [], []
    learn_rows, learn_over = ctl.observe_step, ctl.observe_overhead
    ctl.observe_step = lambda r, s, k=0.0: (rows.append(r), learn_rows(r, s, k))[1]
    ctl.observe_overhead = lambda s, v=False: (over.append(v), learn_over(s, v))[1]
    eng.set_controller(ctl)
    eng.reset_prefix_cache()
    counts = iter(range(1, 1000))
    fake = {"on": False}
    real = eng._captures
    # every step "captures" while `on`: a fresh count at each check
    eng._captures = lambda: next(counts) if fake["on"] else real()
    try:
        prompt = max(target.prompts, key=len)
        eng.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        eng.step()  # the prefill
        fake["on"] = True
        for _ in range(3):
            eng.step()
        assert rows == [] and over == []
        fake["on"] = False
        eng._fresh_captures()  # (the count as it stands)
        while eng.has_unfinished():
            eng.step()
        assert rows and over  # steps without a capture teach again
    finally:
        eng._captures = real
        eng.set_controller(None)
