"""The speculation controller's probes and re-planning (engine/spec_control.py): where drafts do
not pay, a sequence still verifies one draft now and then, backing off while probes fail; new
sequences start from what earlier requests learnt; settled sequences re-plan every few steps."""
from __future__ import annotations

from specdeploy.engine.spec_control import MAX_PROBE_GAP, CostController
from tests.spec.cost_models import MIXED, NEVER, _Seq


def test_failed_probes_back_off():
    """At a cost where drafts never pay, a sequence probes with one draft after
    probe_every steps at 0; every rejected probe doubles the gap, up to MAX_PROBE_GAP, every
    accepted one halves it, down to probe_every."""
    c = CostController(NEVER, 3, 3, probe_every=2)
    s = _Seq()
    probes = []
    for step in range(200):
        c.plan([s])
        if s.spec.limit:
            probes.append(step)
            c.observe(s, 0, 1, False)  # the probe's draft is rejected
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [2, 4, 8, 16, 32] and set(gaps[5:]) == {MAX_PROBE_GAP}
    for want in (16, 8, 4, 2, 2):  # each accepted probe halves the gap, down to probe_every
        c.observe(s, 1, 1, False)
        assert s.spec.control.gap == want
    c.observe(s, 0, 1, False)
    assert s.spec.control.gap == 4


def test_settled_sequences_replan_every_few_steps(monkeypatch):
    """A sequence planned at 0 drafter drafts is not re-planned (allocate's host time) until a
    verify teaches its acceptance or REPLAN_EVERY steps pass; its probes still come, and a
    step with other rows (lookup runs) plans in full."""
    from specdeploy.engine.spec_control import REPLAN_EVERY

    c = CostController(NEVER, 3, 3, probe_every=4)
    calls = []
    real = c.allocate
    monkeypatch.setattr(c, "allocate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    s = _Seq()
    s.spec.behind = None
    limits = []
    for _ in range(2 * REPLAN_EVERY):
        c.plan([s])
        limits.append(s.spec.limit)
    assert len(calls) == 2  # the first plan, then one REPLAN_EVERY steps later
    assert limits.count(1) >= 2 and set(limits) == {0, 1}  # the probes (every 4 idle steps)
    c.observe(s, 0, 1, False)  # a probe's verify: re-planned at once
    c.plan([s])
    assert len(calls) == 3
    c.plan([s], fixed_rows=4)  # other rows this step: planned in full
    assert len(calls) == 4


def test_a_new_sequence_starts_at_the_last_probe_gap():
    """Probes that keep failing back off to MAX_PROBE_GAP; the next request starts there (not
    at probe_every again), and one that starts before any drafter verify at probe_every."""
    from specdeploy.engine.spec_control import MAX_PROBE_GAP

    c = CostController(NEVER, 3, 3, probe_every=4)
    assert c.state(_Seq()).gap == 0  # nothing learnt yet: probe_every
    s = _Seq()
    for _ in range(6):
        c.observe(s, 0, 1, False)
    assert c.state(s).gap == MAX_PROBE_GAP
    assert c.state(_Seq()).gap == MAX_PROBE_GAP
    c.observe(s, 1, 1, False)  # an accepted probe halves it, for newcomers too
    assert c.state(_Seq()).gap == MAX_PROBE_GAP // 2


def test_lookup_probes_are_batch_times_rarer():
    """Lookup drafts that cannot pay are cut to none, and a sequence probes with one draft when
    its probe is due: every `probe_every` steps alone, B times more rarely beside B - 1 others
    (the acceptance tables a probe teaches are global: a batch gets as many probes a step)."""
    from types import SimpleNamespace

    def probes(batch: int, steps: int = 64) -> list[int]:
        c = CostController(NEVER, 3, 4, drafter=False, probe_every=4)
        seqs = [SimpleNamespace(spec=SimpleNamespace(control=None)) for _ in range(batch)]
        n = [0] * batch
        for _ in range(steps):
            for s in seqs:  # each step: a fresh lookup match of 4 drafts, cheap to copy
                s.spec.drafts, s.spec.from_lookup, s.spec.store_conf = [1, 2, 3, 4], True, None
                s.spec.lookup_copy, s.spec.draft_probs = 2, None
            c.cut(seqs)
            for i, s in enumerate(seqs):
                assert len(s.spec.drafts) in (0, 1)  # cut to none, or a probe
                n[i] += len(s.spec.drafts)
        return n

    assert probes(1) == [16]  # every 4th step
    assert probes(4) == [4] * 4  # every 16th: the batch as a whole still probes every 4th


def test_a_new_sequences_first_plan_probes():
    """Where drafts never pay, a new sequence still verifies one draft at its first plan (one
    probe a request: acceptance differs between requests), then waits out its gap; one
    starting where a draft is modelled near even probes every probe_every steps, whatever gap
    the last request left."""
    c = CostController(NEVER, 3, 3, probe_every=4)
    s = _Seq()
    limits = []
    for _ in range(6):
        c.plan([s])
        limits.append(s.spec.limit)
    assert limits == [1, 0, 0, 0, 1, 0]
    c._last_gap = MAX_PROBE_GAP
    assert c.state(_Seq()).gap == MAX_PROBE_GAP  # far from even: the last request's gap
    near = CostController(MIXED, 3, 3, probe_every=4, prior=0.5)
    assert near._near_even(near.glob["model"])
    near._last_gap = MAX_PROBE_GAP
    assert near.state(_Seq()).gap == 4
