"""method="ngram": n-gram lookup drafts with no drafter model, on every tiny target (Llama,
NemotronH, Qwen3.5-MoE). Oracle: the non-speculative path of the same deployment code."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from tests.spec.tiny_targets import LIMITS

MAX_TOKENS = 20
PROMPTS = [[5, 6, 7, 8] * 6, [9, 4] * 3 + [9]]


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ngram_llm(target):
    # controller="off": these tests count lookup steps; the measured cost controller may cut
    # every lookup on a slow machine (CI once saw lookup_steps == 0 on nemotron_h), and its own
    # losslessness is tested over synthetic cost models (test_spec_controller.py)
    return LLM(str(target.path), spec=SpecConfig("ngram", 3, prompt_lookup_num_tokens=6,
                                                 controller="off"), **LIMITS)


def test_ngram_greedy_equals_non_spec(target, ngram_llm):
    """Looping and random prompts, batch 4 then batch 1: same tokens as without speculation;
    steps without a match decode plainly (undrafted)."""
    prompts = PROMPTS + target.prompts[1:3]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _ids(target.llm().generate(prompts, params))
    llm = ngram_llm
    llm.engine.set_lookup((4, 2), 6)  # resets the counters
    assert _ids(llm.generate(prompts, params)) == want
    assert _ids(llm.generate([prompts[0]], params)) == [want[0]]
    s = llm.stats()
    assert s["lookup_steps"] > 0 and s["lookup_steps"] == s["draft_steps"]
    assert s["undrafted_steps"] > 0
    assert llm.deployed.drafter is None and llm.deployed.target.ctx.capture_layers == ()


def test_ngram_forced_drafts_roll_state_forward(target, ngram_llm):
    """6 right drafts per step (the target's own greedy tokens): all accepted, so a hybrid's
    spec state is read at entry 6 (sized for max(K, prompt_lookup_num_tokens) + 1)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _ids(target.llm().generate(target.prompts, SamplingParams(
        max_tokens=MAX_TOKENS + 8, ignore_eos=True)))
    by_prompt = {tuple(p): w for p, w in zip(target.prompts, want)}
    llm = ngram_llm
    llm.engine.set_lookup((4, 2), 6)

    def forced(seq, n):
        start = len(seq.output_ids)
        return by_prompt[tuple(seq.prompt_ids)][start:start + n]

    llm.engine.fix_drafts(forced)
    try:
        assert _ids(llm.generate(target.prompts, params)) == [w[:MAX_TOKENS] for w in want]
        s = llm.stats()
    finally:
        llm.engine.fix_drafts(None)
    assert s["mean_accepted_length"] == 7
    assert s["accepted_per_position"] == [s["draft_steps"]] * 6


def test_ngram_sampling_is_seeded(target, ngram_llm):
    llm = ngram_llm
    llm.engine.set_lookup((4, 1), 6)

    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate([[5, 6, 7] * 5], p)[0].token_ids

    assert run(3) == run(3)
    assert len({tuple(run(s)) for s in range(4)}) > 1
    assert llm.stats()["lookup_steps"] > 0


def test_ngram_config():
    assert SpecConfig("ngram").prompt_lookup_max == 4
    assert SpecConfig("ngram", prompt_lookup_max=3).prompt_lookup_max == 3
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig("ngram", draft_model="somewhere")
    with pytest.raises(ValueError, match="ngram"):
        SpecConfig("ngrams")
