"""The cost-aware speculation controller (engine/spec_control.py) in the engine: it verifies no
drafts where a synthetic cost model says none can pay and all K where drafts are free, and with
it greedy speculation still equals plain greedy decoding token for token (oracle: the
non-speculative engine), with EAGLE-3, MTP and n-gram lookup drafts; sampled requests still go
through rejection sampling. Its decisions alone: test_spec_controller_plan.py, _learn.py and
_probes.py."""
from __future__ import annotations

import pytest

from specdeploy import SamplingParams
from specdeploy.engine import verify_rows
from specdeploy.engine.spec_calibrate import calibrate
from specdeploy.engine.spec_control import CostController
from tests.spec.cost_models import FREE, MIXED, NEVER
from tests.spec.host_syncs import count_host_syncs

MAX_TOKENS = 16


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(target):
    llm = target.llm()
    return _ids(llm.generate(target.prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                            ignore_eos=True)))


def _controlled(target, controller, lookup=None):
    llm = target.llm(3)
    llm.engine.set_lookup(lookup)
    llm.engine.set_controller(controller)
    llm.engine.reset_spec_stats()
    return llm


def test_never_pays_verifies_no_drafts(target, baseline, monkeypatch):
    llm = _controlled(target, CostController(NEVER, 3, 3, probe_every=0))
    d, eng = llm.deployed, llm.engine
    rows, forwards = [], []
    fwd, dfwd = d.forward, d.draft_forward
    monkeypatch.setattr(d, "forward", lambda m: (rows.append(m.num_tokens), fwd(m))[1])
    monkeypatch.setattr(d, "draft_forward",
                        lambda m, h, **kw: (forwards.append(1), dfwd(m, h, **kw))[1])
    try:
        for p in target.prompts:
            eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        eng.step()  # the prefills (153 tokens fit one step)
        rows.clear()
        forwards.clear()
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        # every decode step is plain: one row per running sequence, no drafter forward
        assert max(rows) <= len(target.prompts) and not forwards
        s = llm.stats()
        assert s["draft_steps"] == 0 and s["controlled_steps"] > 0
        assert s["steps_by_num_drafts"][0] == s["controlled_steps"]
        assert [o.token_ids for o in outs.values()] == baseline
    finally:
        eng.set_controller(None)


def test_free_drafts_verify_k(target, baseline):
    llm = _controlled(target, CostController(FREE, 3, 3, probe_every=0))
    try:
        assert _ids(llm.generate(target.prompts, SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True))) == baseline
        s = llm.stats()
        assert s["draft_steps"] > 0 and s["steps_by_num_drafts"][:3] == [0, 0, 0]
        assert s["draft_tokens"] == 3 * s["draft_steps"]
    finally:
        llm.engine.set_controller(None)


@pytest.mark.parametrize("lookup", [None, (3, 1)])
def test_greedy_lossless_with_controller(target, baseline, lookup):
    """Decisions that vary (probes every 3 steps, acceptance that moves them) and deferred
    drafter catch-ups: still the plain greedy output, batch 1 and a mixed batch."""
    llm = _controlled(target, CostController(MIXED, 3, 3, probe_every=3), lookup)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        assert _ids(llm.generate(target.prompts, params)) == baseline
        assert _ids(llm.generate([target.prompts[3]], params)) == [baseline[3]]
        s = llm.stats()
        assert s["controlled_steps"] > 0 and s["draft_steps"] > 0  # both kinds of step ran
    finally:
        llm.engine.set_controller(None)
        llm.engine.set_lookup(None)


def test_deferred_catch_up_drafts_as_if_never_skipped(target):
    """A sequence given no drafts for some steps defers the drafter's catch-up; its drafts
    after catching up are those of a run that drafted every step (oracle: controller off)."""
    if target.method == "ngram":
        pytest.skip("no drafter")
    prompt = target.prompts[2]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    def drafts_by_len(llm):
        seen = {}
        orig = llm.engine._after_step

        def after(batch, *a):
            orig(batch, *a)
            for s in batch:
                if s.seq.spec.drafts:
                    seen[len(s.seq)] = list(s.seq.spec.drafts)
        llm.engine._after_step = after
        try:
            llm.generate([prompt], params)
        finally:
            del llm.engine._after_step
        return seen

    llm = target.llm(3)
    full = drafts_by_len(llm)

    class Scripted(CostController):
        def plan(self, seqs, *others):
            for s in seqs:  # 0 drafts at two of every three lengths
                s.spec.limit = 3 if len(s) % 3 == 0 else 0

    llm.engine.set_controller(Scripted(FREE, 3, 3))
    try:
        part = drafts_by_len(llm)
    finally:
        llm.engine.set_controller(None)
    assert part and all(n % 3 == 0 for n in part)
    common = [n for n in part if n in full]
    assert common and all(part[n] == full[n] for n in common)


def test_sampled_requests_keep_rejection_sampling(target, monkeypatch):
    calls = []
    verify = verify_rows.verify
    monkeypatch.setattr(verify_rows, "verify",
                        lambda logits, drafts, *a: (calls.append(drafts.ids.shape), verify(
                            logits, drafts, *a))[1])
    llm = _controlled(target, CostController(FREE, 3, 3, probe_every=0))
    try:
        outs = llm.generate(target.prompts[:3], [SamplingParams(
            max_tokens=8, ignore_eos=True, temperature=0.8, seed=i) for i in range(3)])
        assert all(len(o.token_ids) == 8 for o in outs)
        assert calls and any(shape[1] == 3 for shape in calls)
    finally:
        llm.engine.set_controller(None)


def test_one_sync_per_step_with_controller(target):
    llm = _controlled(target, CostController(MIXED, 3, 3, probe_every=2), (3, 1))
    eng = llm.engine
    forwards = []
    dfwd = llm.deployed.draft_forward
    llm.deployed.draft_forward = lambda m, h, **kw: (forwards.append(1), dfwd(m, h, **kw))[1]
    try:
        for i, p in enumerate(target.prompts[:4]):
            eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True, seed=i,
                                              temperature=0.8 if i % 2 else 0.0))
        for _ in range(2):
            eng.step()
        for _ in range(6):
            forwards.clear()
            with count_host_syncs() as counts:
                eng.step()
            n = sum(v for f, v in counts.items() if f.startswith("engine/"))
            assert n <= 1 + len(forwards), dict(counts)
    finally:
        del llm.deployed.draft_forward
        while eng.has_unfinished():
            eng.step()
        eng.set_controller(None)
        eng.set_lookup(None)


def test_calibration_measures_and_leaves_the_engine_as_it_was(target, baseline):
    if target.arch != "llama":
        pytest.skip("one calibration is enough")
    llm = target.llm(3)
    eng = llm.engine
    m = calibrate(eng, batches=(1,), reps=1)
    assert {1, 2, 3, 4} <= set(m.target) and all(v > 0 for v in m.target.values())
    assert m.draft and all(v > 0 for v in m.draft.values())
    # the drafter's catch-ups of deferred rows are timed too (`_time_catch_ups`)
    assert {8, 16} <= set(m.draft)
    assert eng.controller is None and eng.source is eng.own_source
    assert not eng.has_unfinished() and eng.stats.num_requests == 0
    assert llm.stats()["draft_steps"] == 0
    eng.set_controller(CostController(m, 3, 3))
    try:
        assert _ids(llm.generate(target.prompts, SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True))) == baseline
    finally:
        eng.set_controller(None)


def test_bad_controller_is_refused(target):
    from specdeploy import SpecConfig

    with pytest.raises(ValueError, match="controller"):
        SpecConfig("mtp", controller="fast")
    with pytest.raises(ValueError, match="controller"):
        target.llm(3).engine.set_controller("fast")


def test_lookup_first_leaves_the_drafter_alone(target, baseline, monkeypatch):
    """With a drafter, lookup and the controller, a sequence whose tail matches takes lookup
    drafts and runs no drafter forward that step (its catch-up deferred); output unchanged."""
    if target.method == "ngram":
        pytest.skip("no drafter")
    llm = _controlled(target, CostController(FREE, 3, 3, probe_every=0), (2, 1))
    d, eng = llm.deployed, llm.engine
    log = []  # per step: (every drafting sequence had a lookup match, drafter forwards)
    calls = []
    dfwd = d.draft_forward
    monkeypatch.setattr(d, "draft_forward",
                        lambda m, h, **kw: (calls.append(1), dfwd(m, h, **kw))[1])
    orig = eng._after_step

    def after(batch, *a):
        calls.clear()
        orig(batch, *a)
        live = [s.seq for s in batch if not s.seq.finished and s.seq.spec.drafts]
        if live and len(live) == len(batch):
            log.append((all(s.spec.from_lookup and s.spec.limit == 0 for s in live),
                        len(calls)))
    monkeypatch.setattr(eng, "_after_step", after)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = [llm.generate([p], params)[0] for p in target.prompts]  # batch 1: step = seq
        assert _ids(outs) == baseline
        all_lookup = [n for ok, n in log if ok]
        assert all_lookup and not any(all_lookup)  # steps of lookup matches only: no forward
        assert any(n for ok, n in log if not ok)  # the drafter still drafts elsewhere
    finally:
        eng.set_controller(None)
        eng.set_lookup(None)
