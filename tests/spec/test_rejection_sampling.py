"""Rejection sampling keeps the target's distribution (chi-square against exact softmax probs)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdeploy import SamplingParams
from specdeploy.engine.speculative import rejection_sample

V = 6
TRIALS = 6000


def _emitted(p, q, k, gen):
    """Run draft-then-verify once; return the first two emitted tokens."""
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
    a, nxt = rejection_sample(p, q, drafts, gen)
    out = drafts[:a] + [nxt]
    return out[0], (out[1] if len(out) > 1 else None)


@pytest.mark.parametrize("disagree", [False, True, "one-hot"])
def test_first_token_follows_target(disagree):
    """`one-hot`: deterministic drafts (n-gram lookup), q = 1 on the drafted token."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0]] * 3), -1)
    if disagree == "one-hot":
        q = torch.nn.functional.one_hot(torch.tensor([1, 4]), V).float()
    elif disagree:  # the drafter puts its mass where the target puts almost none
        q = torch.softmax(torch.tensor([[-3.0, -2.0, -1.0, 0.0, 2.5, 3.0]] * 2), -1)
    else:
        q = torch.softmax(torch.tensor([[1.5, 1.0, 0.5, 0.0, -0.5, -1.0]] * 2), -1)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        first, _ = _emitted(p, q, 2, gen)
        counts[first] += 1
    expected = p[0] * TRIALS
    stat = chisquare(counts.numpy(), expected.numpy())
    assert stat.pvalue > 1e-3, (counts, expected)


def test_second_token_follows_target_given_first():
    """Position-dependent target rows: the second token, given the first, follows p[1]."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(2, V, generator=gen) * 2, -1)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        _, second = _emitted(p, q, 2, gen)
        if second is not None:
            counts[second] += 1
    # NOTE: p rows do not depend on the first token here, so P(second) = p[1] whenever a second
    # token is emitted (the first draft accepted).
    n = counts.sum()
    assert n > 500
    stat = chisquare(counts.numpy(), (p[1] * n).numpy())
    assert stat.pvalue > 1e-3, (counts, p[1] * n)


@pytest.mark.parametrize("lookup", [None, (4, 1)])
def test_sampled_speculation_is_seeded_and_samples(target, lookup):
    llm = target.llm(2)
    llm.engine.set_lookup(lookup)  # resets the counters
    prompt = target.prompts[1] if lookup is None else [5, 6, 7] * 5

    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate([prompt], p)[0].token_ids

    try:
        assert run(3) == run(3)
        assert len({tuple(run(s)) for s in range(4)}) > 1
        assert (llm.stats()["lookup_steps"] > 0) == (lookup is not None)
    finally:
        llm.engine.set_lookup(None)
