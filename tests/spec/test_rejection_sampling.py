"""`engine.verify`: rejection sampling keeps the target's distribution (chi-square against the
exact softmax probabilities), greedy acceptance is the longest matching prefix, and the
vectorized batch equals a naive one-row-at-a-time reference draw for draw."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdeploy import SamplingParams
from specdeploy.engine.verify import Drafts, verify, verify_greedy

V = 6
TRIALS = 6000
SAMPLED = SamplingParams(temperature=1.0)


def _emitted(p: torch.Tensor, q: torch.Tensor, k: int, gen: torch.Generator):
    """TRIALS independent draft-then-verify runs in one batch: first two emitted tokens."""
    drafts = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=gen)
                          for i in range(k)], 1)  # [TRIALS, k]
    logits = p.log()[None].expand(TRIALS, -1, -1)
    rows = Drafts(drafts, torch.full((TRIALS,), k), q[None].expand(TRIALS, -1, -1))
    num, nxt = verify(logits, rows, [SAMPLED] * TRIALS, [None] * TRIALS, gen)
    first = torch.where(num > 0, drafts[:, 0], nxt)
    second = torch.where(num > 1, drafts[:, 1], torch.where(num == 1, nxt, -1))
    return first, second


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
    first, _ = _emitted(p, q, 2, gen)
    counts = torch.bincount(first, minlength=V).double()
    stat = chisquare(counts.numpy(), (p[0].double() / p[0].double().sum() * TRIALS).numpy())
    assert stat.pvalue > 1e-3, (counts, p[0] * TRIALS)


def test_second_token_follows_target_given_first():
    """Position-dependent target rows: the second token, given the first, follows p[1]."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(2, V, generator=gen) * 2, -1)
    _, second = _emitted(p, q, 2, gen)
    # NOTE: p rows do not depend on the first token here, so P(second) = p[1] whenever a second
    # token is emitted (the first draft accepted).
    counts = torch.bincount(second[second >= 0], minlength=V).double()
    n = counts.sum()
    assert n > 500
    stat = chisquare(counts.numpy(), (p[1].double() / p[1].double().sum() * n).numpy())
    assert stat.pvalue > 1e-3, (counts, p[1] * n)


def _verify_ref(logits, drafts, length, q, gen):
    """One row, the textbook loop (the same draws in the same order as `verify`'s row)."""
    p = logits.softmax(-1)
    u = torch.rand(length, generator=gen)
    noise = torch.empty(p.shape[-1]).exponential_(generator=gen)
    for a in range(length):
        d = drafts[a]
        if not u[a] < min(1.0, float(p[a, d] / max(float(q[a, d]), 1e-20))):
            residual = (p[a] - q[a]).clamp_min(0)
            dist = residual if residual.sum() > 0 else p[a]
            return a, int((dist / noise).argmax())
    return length, int((p[length] / noise).argmax())


def test_batch_equals_row_by_row_reference():
    """Mixed lengths (0 included: a plain sample), seeded rows with their own generators."""
    torch.manual_seed(3)
    s, k, v = 5, 3, 11
    logits = torch.randn(s, k + 1, v) * 2
    q = torch.softmax(torch.randn(s, k, v) * 2, -1)
    lengths = torch.tensor([3, 0, 2, 1, 3])
    ids = torch.stack([torch.multinomial(q[i], 1).squeeze(-1) for i in range(s)])
    ids[torch.arange(k)[None] >= lengths[:, None]] = 0
    for i in range(s):
        q[i, lengths[i]:] = 0
    seeds = list(range(10, 10 + s))
    gens = [torch.Generator().manual_seed(x) for x in seeds]
    num, nxt = verify(logits, Drafts(ids, lengths, q), [SAMPLED] * s, gens)
    for i in range(s):
        want = _verify_ref(logits[i], ids[i].tolist(), int(lengths[i]), q[i],
                           torch.Generator().manual_seed(seeds[i]))
        assert (int(num[i]), int(nxt[i])) == want, i


def test_greedy_accepts_the_matching_prefix():
    logits = torch.full((3, 4, 7), -1.0)
    best = torch.tensor([[2, 5, 1, 6], [2, 5, 1, 6], [4, 4, 4, 4]])
    logits.scatter_(-1, best[..., None], 1.0)
    drafts = Drafts(torch.tensor([[2, 5, 0], [2, 3, 1], [4, 4, 4]]), torch.tensor([3, 3, 2]))
    for d in (drafts, Drafts.of([[2, 5, 0], [2, 3, 1], [4, 4]])):  # by hand, and as built
        num, nxt = verify(logits, d, [SamplingParams()] * 3, [None] * 3)
        assert num.tolist() == [2, 1, 2]  # row 0 stops at a wrong third draft; 2 at its length
        assert nxt.tolist() == [1, 5, 4]
        assert verify_greedy(logits.argmax(-1), d)[0].tolist() == [2, 1, 2]
