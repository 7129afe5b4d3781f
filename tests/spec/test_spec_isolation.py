"""Under speculation too, one sequence's failure (verification, drafting) finishes it alone
with "error": the others in the batch give exactly their greedy non-speculative outputs, its
pages and slot come back, and the engine stays usable."""
from __future__ import annotations

import pytest

import specdeploy.engine.speculative as spec_mod
from specdeploy import SamplingParams

POISON_SEED = 666
MAX_TOKENS = 10


def _poisoned(seqs) -> bool:
    return any(s.params.seed == POISON_SEED for s in seqs)


def _run(target, llm):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    poison = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=POISON_SEED,
                            ignore_eos=True)
    prompts = target.prompts[:3]
    want = [o.token_ids for o in target.llm().generate(prompts, greedy)]
    outs = llm.generate(prompts + [target.prompts[3]], [greedy] * 3 + [poison])
    assert [o.token_ids for o in outs[:3]] == want
    bad = outs[3]
    assert bad.finish_reason == "error" and "injected" in bad.error
    eng = llm.engine
    assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.num_pages
    assert len(eng.blocks.free_slots) == eng.blocks.num_slots
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want  # still usable


def test_verify_failure_fails_one_sequence(target, monkeypatch):
    llm = target.llm(3)
    real = spec_mod.SpecEngine._verify_rows
    calls = {"n": 0}

    def flaky(self, logits, rows, k1, seqs):
        if _poisoned(seqs):
            calls["n"] += 1
            if calls["n"] >= 3:  # mid-stream, after a few tokens
                raise ValueError("injected verify failure")
        return real(self, logits, rows, k1, seqs)

    monkeypatch.setattr(spec_mod.SpecEngine, "_verify_rows", flaky)
    _run(target, llm)


@pytest.mark.parametrize("lookup", [None, (3, 1)])
def test_drafting_failure_fails_one_sequence(target, lookup, monkeypatch):
    llm = target.llm(3)
    llm.engine.set_lookup(lookup)
    source = llm.engine.source
    real = source.propose
    calls = {"n": 0}

    def flaky(work, captured):
        if _poisoned([w.seq for w in work]):
            calls["n"] += 1
            if calls["n"] >= 3:
                raise RuntimeError("injected drafting failure")
        return real(work, captured)

    monkeypatch.setattr(source, "propose", flaky)
    try:
        _run(target, llm)
    finally:
        llm.engine.set_lookup(None)
