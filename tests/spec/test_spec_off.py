"""Speculation off by batch size (`SpecConfig.disable_by_batch_size`, vLLM's name, and the cost
controller's `off_batches` from the calibration table): exact arithmetic of the automatic
choice; steps above the threshold run no drafts and stay lossless (oracle: the plain engine's
greedy output); a drafter that skipped steps catches up and then drafts what a run that never
skipped drafts (oracle: the same engine with no threshold)."""
from __future__ import annotations

import pytest

from specdeploy import SamplingParams, SpecConfig
from specdeploy.engine.spec_calibrate import OFF_BREAK_EVEN, OFF_MIN_BATCH, off_batches

MAX_TOKENS = 16


def _linear(fixed: float, per_row: float):
    return lambda rows: fixed + per_row * rows


def test_off_batches_where_one_draft_a_sequence_needs_a_high_acceptance():
    # t(2B) / t(B) - 1 = per_row * B / (fixed + per_row * B): 0.324 at 8, 0.490 at 16
    cost = _linear(1.0, 0.06)
    assert cost(32) / cost(16) - 1 >= OFF_BREAK_EVEN > cost(16) / cost(8) - 1
    assert off_batches(cost, (1, 3, 16), 20) == frozenset(range(16, 21))
    assert off_batches(cost, (1, 3, 8), 16) == frozenset()  # 16 never calibrated: not judged
    # between 8 (0.324) and 16 (0.490) the ratio crosses 0.4 at 8 + 8 * 0.076 / 0.166 = 11.66
    assert off_batches(cost, (1, 3, 8, 16), 16) == frozenset(range(12, 17))
    assert off_batches(cost, (1, 3, 8, 16), 20) == frozenset(range(12, 21))
    # above at 8 already: from 8; a ratio falling under it again (noise) changes nothing
    assert off_batches(_linear(1.0, 0.1), (1, 3, 8, 16), 16) == frozenset(range(8, 17))
    table = {8: 1.0, 16: 1.45, 32: 1.6}.__getitem__  # r(8) = 0.45, r(16) = 0.10
    assert off_batches(table, (8, 16), 16) == frozenset(range(8, 17))
    # a flat (memory-bound) step: drafts pay at any acceptance
    assert off_batches(_linear(1.0, 0.0), (1, 3, 16), 16) == frozenset()


def test_small_batches_are_not_judged():
    """Below OFF_MIN_BATCH a doubling looks dear on a noisy timing, not on the hardware."""
    steep_small = {1: 1.0, 2: 1.1, 3: 1.0, 6: 2.0, 16: 3.0, 32: 3.3}
    cost = steep_small.__getitem__
    assert 3 < OFF_MIN_BATCH <= 16
    assert cost(6) / cost(3) - 1 >= OFF_BREAK_EVEN
    assert off_batches(cost, (1, 3, 16), 16) == frozenset()


def test_bad_disable_by_batch_size_is_refused_by_name():
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            SpecConfig("ngram", disable_by_batch_size=bad)
    assert SpecConfig.from_dict({"method": "ngram",
                                 "disable_by_batch_size": 4}).disable_by_batch_size == 4


def test_cli_flag():
    import argparse

    from specdeploy.spec_args import add_spec_args, spec_from_args

    p = argparse.ArgumentParser()
    add_spec_args(p)
    spec = spec_from_args(p.parse_args(["--spec", "ngram", "--spec-disable-by-batch-size", "3"]))
    assert spec.disable_by_batch_size == 3
    assert spec_from_args(p.parse_args(["--spec", "ngram"])).disable_by_batch_size is None


def _ids(outs):
    return [o.token_ids for o in outs]


def test_steps_above_the_threshold_draft_nothing_and_stay_lossless(target):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _ids(target.llm().generate(target.prompts, params))
    llm = target.llm(3)
    eng = llm.engine
    eng.set_lookup((3, 1))
    eng.disable_by_batch_size = 1
    try:
        eng.reset_spec_stats()
        assert _ids(llm.generate(target.prompts, params)) == plain
        s = llm.stats()
        assert s["batch_off_steps"] > 0 and s["spec_off_batch_sizes"][0] == 2
        # after every step: where more than one sequence decodes next, none has drafts
        crowded = []
        orig = eng._after_step

        def after(batch, *rest):
            orig(batch, *rest)
            going = [s.seq for s in batch
                     if not s.seq.finished and s.seq.num_cached == len(s.seq) - 1]
            if len(going) > 1:
                crowded.append(sum(len(q.spec.drafts) for q in going))
        eng._after_step = after
        try:
            eng.reset_spec_stats()
            assert _ids(llm.generate(target.prompts, params)) == plain
        finally:
            del eng._after_step
        assert crowded and not any(crowded)
        # one sequence alone drafts again
        eng.reset_spec_stats()
        assert _ids(llm.generate([target.prompts[3]], params)) == [plain[3]]
        s = llm.stats()
        assert s["draft_steps"] > 0 and s["batch_off_steps"] == 0
    finally:
        eng.disable_by_batch_size = None
        eng.set_lookup(None)


def test_a_drafter_catches_up_after_steps_off(target):
    """Request A runs beside a short request B (2 sequences: speculation off, the drafter's
    rows deferred), then alone: its drafts after the catch-up are those of a run of A alone,
    which drafted every step."""
    if target.method == "ngram":
        pytest.skip("no drafter")
    a, b = target.prompts[2], target.prompts[4]
    long_p = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    short_p = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = target.llm(3)
    eng = llm.engine

    def drafts_of_a(run):
        seen = {}
        orig = eng._after_step

        def after(batch, *rest):
            orig(batch, *rest)
            for s in batch:
                if s.seq.spec.drafts and s.seq.prompt_ids == a:
                    seen[len(s.seq)] = list(s.seq.spec.drafts)
        eng._after_step = after
        try:
            outs = run()
        finally:
            del eng._after_step
        return seen, outs

    full, (alone,) = drafts_of_a(lambda: llm.generate([a], long_p))
    eng.disable_by_batch_size = 1
    try:
        eng.reset_spec_stats()
        part, outs = drafts_of_a(lambda: llm.generate([a, b], [long_p, short_p]))
        stats = llm.stats()
    finally:
        eng.disable_by_batch_size = None
    assert outs[0].token_ids == alone.token_ids
    assert stats["batch_off_steps"] > 0 and part
    common = [n for n in part if n in full]
    assert common and all(part[n] == full[n] for n in common)
