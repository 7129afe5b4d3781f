"""`verify_greedy_lists` (the CPU's host verify) and `member_rows` against the torch path they
replace: equal accepted lengths and next tokens on random batches (issue 21)."""
from __future__ import annotations

import random

import pytest
import torch

from specdeploy.engine.verify import Drafts, member_rows, verify_greedy, verify_greedy_lists


def _torch_path(logits, rows, k1, drafts):
    index = torch.tensor([list(r) + list(r[-1:]) * (k1 - len(r)) for r in rows])
    num, nxt = verify_greedy(logits.argmax(-1)[index], Drafts.of(drafts))
    return num.tolist(), nxt.tolist()


@pytest.mark.parametrize("seed", range(30))
def test_verify_greedy_lists_equals_torch_path(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 50])  # small vocabularies: drafts often match
    num_logits = [rng.choice([0, 1, 1 + rng.randrange(6)]) for _ in range(rng.randrange(1, 6))]
    samples = [n > 0 and rng.random() < 0.9 for n in num_logits]
    if not any(samples):
        samples[0], num_logits[0] = True, max(num_logits[0], 1)
    rows, live, k1 = member_rows(tuple(num_logits), tuple(samples))
    logits = torch.randn(sum(num_logits), vocab)
    am = logits.argmax(-1).tolist()
    drafts = []
    for r in rows:  # drafts: mostly the target's own argmaxes, then noise
        d = [am[j] if rng.random() < 0.7 else rng.randrange(vocab) for j in r[:-1]]
        drafts.append(d)
    assert verify_greedy_lists(am, rows, drafts, k1) == _torch_path(logits, rows, k1, drafts)


def test_member_rows():
    rows, live, k1 = member_rows((4, 0, 1, 2), (True, False, True, True))
    assert rows == ((0, 1, 2, 3), (4,), (5, 6)) and live == (0, 2, 3) and k1 == 4
    assert member_rows((4, 0, 1, 2), (True, False, True, True))[0] is rows  # computed once
    assert member_rows((0,), (False,)) == ((), (), 0)
