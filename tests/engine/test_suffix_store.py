"""The suffix store (engine/suffix_store.py) against a naive reference: n-gram -> Counter of
next tokens over the same replies, the longest matched tail decides."""
from __future__ import annotations

import collections
import json
import random

import numpy as np
import pytest

import specdeploy.engine.suffix_store as suffix_store
from specdeploy.engine.suffix_store import MAX_N, REBUILD_EVERY, SuffixStore, TokenIndex

V = 7  # a tiny vocabulary: many repeats, ties and long matches


def next_token_ref(docs, tail):
    """(token, count, occurrences) after the longest tail (2..MAX_N) found, ties: smaller id."""
    best = None
    for n in range(2, min(MAX_N, len(tail)) + 1):
        c = collections.Counter()
        for d in docs:
            for i in range(n, len(d)):
                if list(d[i - n:i]) == list(tail[-n:]):
                    c[d[i]] += 1
        if not c:
            break
        top = max(c.values())
        best = (min(t for t, v in c.items() if v == top), top, sum(c.values()))
    return best


def propose_ref(docs, tail, k, min_prob):
    ctx, out, conf, p = list(tail), [], [], 1.0
    for _ in range(k):
        r = next_token_ref(docs, ctx)
        if r is None:
            break
        c = r[1] / (r[2] + 1)
        if p * c < min_prob:
            break
        p *= c
        out.append(r[0])
        conf.append(c)
        ctx.append(r[0])
    return out, conf


def _docs(seed, n=12, longest=40):
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randrange(0, longest))] for _ in range(n)]


@pytest.mark.parametrize("vocab", [V, 70_000])  # the four-token key; the pair key
@pytest.mark.parametrize("seed,longest", [(0, 40), (1, 40), (2, 40), (3, 800)])
def test_next_token_matches_reference(seed, longest, vocab):
    """Short replies (few candidates: counted in Python) and long ones (a 2-token tail has
    ~100 candidates: counted by np.unique); asked twice (the memo)."""
    docs = _docs(seed, longest=longest)
    store = SuffixStore(vocab, TokenIndex(docs, vocab))
    assert store.static.wide == (vocab < (1 << 16) - 1)
    rng = random.Random(100 + seed)
    for _ in range(200):
        tail = [rng.randrange(V) for _ in range(rng.randrange(0, 9))]
        want = next_token_ref(docs, tail)
        assert store.next_token(tail) == want and store.next_token(tail) == want, tail
    if longest > 100:
        assert store.next_token([1, 2])[2] > 64


@pytest.mark.parametrize("min_prob", [0.0, 0.1, 0.4])
def test_propose_matches_reference(min_prob):
    docs = _docs(7)
    store = SuffixStore(V, TokenIndex(docs, V), min_prob=min_prob)
    rng = random.Random(3)
    drafted = 0
    for _ in range(100):
        tail = [rng.randrange(V) for _ in range(rng.randrange(2, 9))]
        d, c = store.propose(tail, 5)
        want_d, want_c = propose_ref(docs, tail[-MAX_N:], 5, min_prob)
        assert d == want_d and c == pytest.approx(want_c, rel=1e-12)
        drafted += len(d)
    assert drafted > 0


def test_replies_do_not_run_into_each_other():
    """The n-gram that spans the end of one reply and the start of the next never matches."""
    store = SuffixStore(10, TokenIndex([[1, 2, 3], [4, 5, 6]], 10))
    assert store.next_token([2, 3]) is None  # 3 ends a reply
    assert store.next_token([3, 4]) is None
    assert store.next_token([1, 2]) == (3, 1, 1)


def test_online_replies_join_and_leave(monkeypatch):
    store = SuffixStore(10, None, max_cached=REBUILD_EVERY + 1)
    assert store.next_token([1, 2]) is None and store.propose([1, 2], 3) == ([], [])
    store.add([1, 2, 3, 4])  # a small online index is rebuilt on every reply
    assert store.next_token([1, 2]) == (3, 1, 1)
    store.add([1, 2, 5])
    assert store.next_token([1, 2]) == (3, 1, 2)
    monkeypatch.setattr(suffix_store, "SMALL", 0)  # a large one every REBUILD_EVERY replies
    store.add([1, 2, 5])
    assert store.next_token([1, 2]) == (3, 1, 2) and store.pending == 1
    for _ in range(REBUILD_EVERY - 1):
        store.add([7, 8, 9])
    assert store.pending == 0  # rebuilt: the bounded cache's oldest replies left
    assert store.next_token([7, 8]) == (9, REBUILD_EVERY - 1, REBUILD_EVERY - 1)
    for _ in range(REBUILD_EVERY):  # the first reply leaves the bounded cache
        store.add([7, 8, 5])
    assert store.next_token([1, 2]) is None
    monkeypatch.undo()
    # the static corpus and the online replies count together at the longest matched tail
    both = SuffixStore(10, TokenIndex([[7, 8, 9], [6, 7, 8, 9]], 10), max_cached=4)
    both.add([6, 7, 8, 5])
    assert both.next_token([6, 7, 8]) == (5, 1, 2)  # the 3-token tail: one 9, one 5
    assert both.next_token([7, 8]) == (9, 2, 3)
    off = SuffixStore(10, None, max_cached=0)
    off.add([1, 2, 3])
    assert off.next_token([1, 2]) is None


def test_save_load_round_trip_and_errors(tmp_path):
    docs = _docs(11)
    cfg = SuffixStore.save(tmp_path / "s", docs, V, meta={"source": "test"})
    assert cfg["num_replies"] == len(docs) and cfg["num_tokens"] == sum(map(len, docs))
    loaded = SuffixStore.load(tmp_path / "s", V)
    ref = SuffixStore(V, TokenIndex(docs, V))
    rng = random.Random(5)
    for _ in range(50):
        tail = [rng.randrange(V) for _ in range(4)]
        assert loaded.next_token(tail) == ref.next_token(tail)
    with pytest.raises(ValueError, match="vocabulary of 7 tokens, the target has 8"):
        SuffixStore.load(tmp_path / "s", 8)
    with pytest.raises(ValueError, match="not a suffix store directory"):
        SuffixStore.load(tmp_path, V)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not a specdeploy-suffix-store"):
        SuffixStore.load(tmp_path / "x", V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SuffixStore.save(tmp_path / "y", [[1, 2, V]], V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenIndex([[1, 2, V]], V)


def test_a_large_vocabulary_keys_exactly():
    """Ids past 2^16 (Qwen's 151k-token vocabulary) key without collisions."""
    v = 151_936
    docs = [[150_000, 2, 151_935, 9], [2, 150_000, 151_935, 8]]
    store = SuffixStore(v, TokenIndex(docs, v))
    assert store.next_token([150_000, 2]) == (151_935, 1, 1)
    assert store.next_token([2, 150_000]) == (151_935, 1, 1)
    assert store.next_token([2, 151_935]) == (9, 1, 1)
    assert np.asarray(store.static.keys).dtype == np.int64


@pytest.mark.parametrize("v", [49_152, (1 << 16) - 2, (1 << 16) - 1])
def test_the_default_vocabulary_keys_four_tokens(v):
    """Below 2^16 - 1 ids the key holds the four tokens before a position (ids + 1, the pad
    0): 3- and 4-token tails are ranges of the sort, the pad never matches a real id; at
    2^16 - 1 the pair key (and filtering) takes over. The same answers either way."""
    docs = [[v - 1, v - 1, 5], [v - 1, 0, 6], [0, v - 1, 7], [3, v - 1, v - 1, 8],
            [4, 3, v - 1, v - 1, 9], [0, 3, v - 1, v - 1, 10, 11]]
    store = SuffixStore(v, TokenIndex(docs, v))
    wide = v < (1 << 16) - 1
    assert np.asarray(store.static.keys).dtype == (np.uint64 if wide else np.uint32)
    assert store.next_token([v - 1, 0]) == (6, 1, 1)
    assert store.next_token([0, v - 1]) == (7, 1, 1)
    assert store.next_token([v - 2, v - 1]) is None
    assert store.next_token([v - 1, v - 1]) == (5, 1, 4)  # a 4-way tie: the smallest id
    assert store.next_token([3, v - 1, v - 1]) == (8, 1, 3)  # n = 3: docs 4, 5, 6
    assert store.next_token([4, 3, v - 1, v - 1]) == (9, 1, 1)  # n = 4
    assert store.next_token([7, 0, 3, v - 1, v - 1]) == (10, 1, 1)  # n = 4, not 5
    assert store.next_token([9, 4, 3, v - 1, v - 1]) == (9, 1, 1)  # n = 4 (no doc has 9 first)
    assert store.next_token([2, 3, v - 1, v - 1, 10]) == (11, 1, 1)
