"""N-gram lookup drafts: the incremental index against a brute-force scan (oracle written here,
straight from the rule's definition), and the config checks."""
from __future__ import annotations

import random

import pytest

from specdeploy import SpecConfig
from specdeploy.engine.lookup import COPY_CAP, NgramIndex, next_lookup_len


def brute_force(ids: list[int], k: int, max_n: int, min_n: int,
                drafts: list[int] = ()) -> list[int] | None:
    """Longest suffix (n in max_n..min_n) of ids + drafts that occurred in `ids` with its next
    token in `ids` too; the latest such occurrence; the K tokens after it, reading the drafts
    themselves once the copy reaches the end."""
    full = ids + list(drafts)
    for n in range(max_n, min_n - 1, -1):
        if len(full) <= n:
            continue
        suffix = full[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                seq = list(full)
                src = start + n
                for _ in range(k):
                    seq.append(seq[src])
                    src += 1
                return seq[len(full):]
    return None


def brute_force_copied(ids: list[int], max_n: int, min_n: int, drafts: list[int] = ()) -> int:
    """The copy length of `brute_force`'s match: how far back from the end ids + drafts agree
    with the text before the occurrence it copies (the n-gram itself included), capped."""
    full = ids + list(drafts)
    for n in range(max_n, min_n - 1, -1):
        if len(full) <= n:
            continue
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == full[-n:]:
                end, c = start + n, 0  # full[:end] ends in the occurrence
                while c < COPY_CAP and end - 1 - c >= 0 and full[end - 1 - c] == full[-1 - c]:
                    c += 1
                return c
    raise AssertionError("no match")


@pytest.mark.parametrize("max_n,min_n", [(4, 2), (3, 3), (2, 1), (5, 1)])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_incremental_index_matches_brute_force(max_n, min_n, k):
    rng = random.Random(max_n * 100 + min_n * 10 + k)
    for trial in range(20):
        vocab = rng.choice([2, 3, 5, 20])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        index = NgramIndex(max_n, min_n)
        for _ in range(40):  # grow by 1..4 tokens between lookups, as accepted runs do
            got = index.propose(ids, k)
            assert got == brute_force(ids, k, max_n, min_n), (trial, ids)
            if got is not None:
                assert index.copied == brute_force_copied(ids, max_n, min_n), (trial, ids)
            drafts = [rng.randrange(vocab) for _ in range(rng.randrange(1, 3))]
            got = index.propose(ids, k, drafts)  # mid-chain lookups never index the drafts
            assert got == brute_force(ids, k, max_n, min_n, drafts), (trial, ids, drafts)
            if got is not None:
                assert index.copied == brute_force_copied(ids, max_n, min_n, drafts)
            ids += [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]


def test_loop_continues_with_its_period():
    index = NgramIndex(4, 2)
    assert index.propose([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert index.propose([9, 9], 3) is None  # (9, 9) has not occurred before; min_n is 2
    assert NgramIndex(4, 1).propose([9, 9], 3) == [9, 9, 9]


def test_copy_length_counts_back_past_the_ngram():
    passage = list(range(100, 130))
    index = NgramIndex(4, 2)
    # the reply repeats the passage's last 12 tokens: 12 copied, the match itself only 4
    ids = [1, *passage, 7, 2, *passage[-12:]]
    assert index.propose(ids, 2) == [7, 2]
    assert index.copied == 12
    long = [5] * 3 + list(range(200, 300))
    index = NgramIndex(4, 2)
    index.propose(long + [9] + long, 1)
    assert index.copied == COPY_CAP  # capped


def test_longest_match_wins_over_a_later_shorter_one():
    ids = [1, 2, 3, 10, 5, 2, 3, 11, 1, 2, 3]
    assert NgramIndex(3, 2).propose(ids, 1) == [10]  # (1, 2, 3) -> 10, not (2, 3) -> 11
    assert NgramIndex(2, 2).propose(ids, 1) == [11]


@pytest.mark.parametrize("kw,match", [
    ({"prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({"prompt_lookup_max": 2.5}, "prompt_lookup_max"),
    ({"prompt_lookup_max": 3, "prompt_lookup_min": 4}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 3, "prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
    ({"prompt_lookup_max": 3, "prompt_lookup_num_tokens": 17}, "prompt_lookup_num_tokens"),
    ({"prompt_lookup_max": 3, "prompt_lookup_num_tokens": True}, "prompt_lookup_num_tokens"),
])
def test_bad_lookup_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig("eagle3", 3, **kw)


def test_max_draft_tokens_covers_the_longest_segment():
    assert SpecConfig("eagle3", 3).max_draft_tokens == 3
    assert SpecConfig("eagle3", 3, prompt_lookup_num_tokens=8).max_draft_tokens == 3  # lookup off
    assert SpecConfig("eagle3", 3, prompt_lookup_max=4).max_draft_tokens == 3
    assert SpecConfig("eagle3", 3, prompt_lookup_max=4,
                      prompt_lookup_num_tokens=8).max_draft_tokens == 8
    assert SpecConfig("eagle3", 5, prompt_lookup_max=4,
                      prompt_lookup_num_tokens=2).max_draft_tokens == 5


def test_lookup_runs_grow_while_accepted_whole():
    """K=3, cap 16: 3 -> 6 -> 12 -> 16 -> 16 while every draft is accepted; any rejection
    goes back to K; a cap at K never grows."""
    n, seen = 3, []
    for _ in range(5):
        n = next_lookup_len(n, True, 3, 16)
        seen.append(n)
    assert seen == [6, 12, 16, 16, 16]
    assert next_lookup_len(16, False, 3, 16) == 3
    assert next_lookup_len(3, True, 3, 3) == 3


def test_ids_between_is_a_slice_of_all_ids():
    from specdeploy.engine.request import SamplingParams, Sequence
    seq = Sequence(list(range(10)), SamplingParams(), None)
    seq.output_ids = list(range(100, 107))
    every = seq.all_ids
    for start in range(len(every) + 2):
        for stop in range(start, len(every) + 3):
            assert seq.ids_between(start, stop) == every[start:stop], (start, stop)
