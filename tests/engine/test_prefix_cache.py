"""Prefix-cache bookkeeping (cache/prefix.py + BlockManager): keys, sharing, LRU eviction,
checkpoints. Host-only: no model (the end-to-end tests are tests/spec/test_prefix_caching.py)."""
from __future__ import annotations

import pytest

from specdeploy.cache.prefix import ROOT, PrefixCache, page_key
from specdeploy.engine.request import SamplingParams, Sequence
from specdeploy.engine.scheduler import BlockManager, Scheduler

PS = 4


def _seq(ids):
    return Sequence(list(ids), SamplingParams(max_tokens=4), None)


def _blocks(num_pages=8, recurrent=False, num_checkpoints=0, every=1):
    prefix = PrefixCache(num_pages, PS, recurrent=recurrent, num_checkpoints=num_checkpoints,
                         checkpoint_every=every)
    return BlockManager(num_pages, PS, 4, prefix), prefix


def _run_prefill(blocks: BlockManager, seq: Sequence) -> None:
    """Admit, allocate and 'compute' the whole prompt, then register its full pages."""
    hit = blocks.match(seq)
    blocks.take_slot(seq)
    blocks.admit(seq, hit)
    blocks.grow(seq, len(seq))
    seq.num_cached = len(seq)
    blocks.prefix.register(seq, seq.num_cached)


def test_keys_chain_the_whole_prefix():
    a, b = page_key(ROOT, [1, 2, 3, 4]), page_key(ROOT, [1, 2, 3, 5])
    assert a != b and len(a) == 16
    # the same page after different prefixes gets different keys
    assert page_key(a, [9, 9, 9, 9]) != page_key(b, [9, 9, 9, 9])
    prefix = PrefixCache(4, PS)
    seq = _seq([1, 2, 3, 4, 9, 9, 9, 9, 7])
    assert prefix.keys(seq, 2) == [a, page_key(a, [9, 9, 9, 9])]
    assert seq.page_keys == prefix.keys(seq, 2)  # memoized on the sequence


def test_hit_shares_full_pages_and_leaves_the_last_token_to_feed():
    blocks, prefix = _blocks()
    a = _seq(range(10, 20))  # 10 tokens: pages 0, 1 full, page 2 partial (not cached)
    _run_prefill(blocks, a)
    assert len(prefix.key_of) == 2
    b = _seq(list(range(10, 18)) + [50, 51, 52])  # shares the two full pages
    hit = blocks.match(b)
    assert hit.pages == a.pages[:2] and hit.checkpoint == -1
    blocks.take_slot(b)
    blocks.admit(b, hit)
    assert b.num_cached == 8 and [prefix.ref[p] for p in hit.pages] == [2, 2]
    assert (prefix.queries, prefix.hits) == (10 + 11, 8)
    c = _seq(range(10, 18))  # all 8 tokens cached: the last page is fed again for its logits
    assert blocks.match(c).pages == a.pages[:1]
    d = _seq([11] + list(range(11, 18)) + [1])  # first page differs: nothing after it hits
    assert blocks.match(d).empty


def test_lru_evicts_unreferenced_pages_only_oldest_first():
    blocks, prefix = _blocks(num_pages=6)
    a, b = _seq(range(0, 9)), _seq(range(100, 109))
    _run_prefill(blocks, a)  # 3 pages each, 2 of them cached
    _run_prefill(blocks, b)
    assert not blocks.free_pages and blocks.num_free == 0
    a_pages = list(a.pages)
    blocks.free(a)  # a's third page was never cached: free; its cached pages: evictable
    assert list(blocks.free_pages) == [a_pages[2]]
    assert list(prefix.evictable) == [a_pages[1], a_pages[0]]  # tail first
    assert blocks.num_free == 3 and len(prefix.evictable) == 2
    c = _seq(range(200, 212))
    assert blocks.can_grow(c, 12) and not blocks.can_grow(c, 13)
    blocks.grow(c, 12)
    # the free page first, then evicted cached pages (a's tail page before its head page)
    assert prefix.evicted_pages == 2 and not prefix.evictable
    assert blocks.match(_seq(range(0, 9))).empty  # a's prefix is gone
    assert blocks.match(_seq(range(100, 109))).pages == b.pages[:2]  # b held its pages


def test_admission_does_not_count_the_hit_pages_as_free():
    blocks, prefix = _blocks(num_pages=4)
    a = _seq(range(0, 9))
    _run_prefill(blocks, a)
    blocks.free(a)  # 2 cached (evictable) + 2 free
    sched = Scheduler(blocks, max_batch_size=4, max_num_tokens=64)
    b = _seq(list(range(0, 8)) + list(range(50, 58)))  # 16 tokens, 8 cached
    sched.add(b)
    (s,) = sched.schedule()
    assert s.num_tokens == 8 and b.num_cached == 8 and len(b.pages) == 4
    assert prefix.hits == 8 and blocks.num_free == 0


def test_recurrent_hits_end_on_a_checkpointed_page():
    blocks, prefix = _blocks(num_pages=8, recurrent=True, num_checkpoints=2, every=2)
    assert prefix.boundaries(0, 17) == [8, 16]  # every second page boundary
    assert prefix.boundaries(8, 8) == [16] and prefix.boundaries(9, 6) == []
    a = _seq(range(0, 17))
    s1, s2 = prefix.take_checkpoint(a, 8), prefix.take_checkpoint(a, 16)
    _run_prefill(blocks, a)
    prefix.end_step()
    assert prefix.ckpt_of == {a.pages[1]: s1, a.pages[3]: s2}
    b = _seq(list(range(0, 14)) + [99, 99, 99])  # 3 pages match; the checkpoint is after 2
    hit = blocks.match(b)
    assert hit.pages == a.pages[:2] and hit.checkpoint == s1
    blocks.take_slot(b)
    blocks.admit(b, hit)
    assert blocks.restores == [(b.slot, s1)]
    # the pool is full: a new checkpoint takes the least recently used one (s2, not s1 just hit)
    c = _seq(range(300, 309))
    assert prefix.take_checkpoint(c, 8) == s2
    assert a.pages[3] not in prefix.ckpt_of
    assert prefix.take_checkpoint(c, 16) == s1  # then s1; both now pending for c
    assert prefix.take_checkpoint(c, 24) is None  # nothing left that is not pending
    prefix.end_step()  # c never registered: its slots go back
    assert sorted(prefix.free_ckpts) == sorted([s1, s2])


def test_duplicate_prefix_stays_private_and_clear_frees_cached_pages():
    blocks, prefix = _blocks(num_pages=8)
    a, b = _seq(range(0, 8)), _seq(range(0, 8))
    for s in (a, b):  # both computed before either registered (admitted in one step)
        blocks.take_slot(s)
        blocks.grow(s, 8)
        s.num_cached = 8
    prefix.register(a, 8)
    prefix.register(b, 8)
    assert set(prefix.key_of) == set(a.pages)
    b_pages = list(b.pages)
    blocks.free(b)  # b's duplicate pages are plain free pages
    assert set(b_pages) <= set(blocks.free_pages) and not prefix.evictable
    blocks.free(a)
    assert blocks.num_free == 8 and len(prefix.evictable) == 2
    blocks.reset_prefix_cache()
    assert len(blocks.free_pages) == 8 and not prefix.key_of


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_checkpoint_every_is_validated(bad):
    from specdeploy.deploy.build import BuildOptions

    with pytest.raises(ValueError, match="checkpoint_every"):
        BuildOptions(checkpoint_every=bad)



@pytest.mark.parametrize("recurrent, every, budget, want", [
    (True, 1, 13, [12, 12, 6]),  # cut chunks end on (checkpointed) page boundaries
    (True, 2, 13, [8, 8, 8, 6]),  # ... on checkpointed ones only
    (True, 1, 3, [3, 1] * 6 + [3, 3]),  # a budget under one step: each boundary ends a chunk
    (False, 1, 13, [13, 13, 4]),  # attention only: nothing to align
])
def test_cut_prefill_chunks_end_on_checkpointed_boundaries(recurrent, every, budget, want):
    """With recurrent checkpoints a prefill cut by the token budget stops at the last
    checkpointed boundary it reaches, so the next chunk's scan starts on one (with pages of the
    scan chunk its boundary states are then chunk ends: free)."""
    blocks, _ = _blocks(num_pages=16, recurrent=recurrent, num_checkpoints=8 if recurrent else 0,
                        every=every)
    sched = Scheduler(blocks, max_batch_size=2, max_num_tokens=budget)
    seq = _seq(range(10, 40))  # 30 tokens
    sched.add(seq)
    fed = []
    while seq.num_pending:
        (s,) = sched.schedule()
        s.seq.num_cached += s.num_tokens
        fed.append(s.num_tokens)
    assert fed == want


@pytest.mark.parametrize("recurrent,want", [(True, [12, 12, 6]), (False, [13, 13, 4])])
def test_recurrent_prefill_chunks_end_on_pages_without_checkpoints(recurrent, want):
    """A recurrent target without prefix checkpoints still cuts prefills on page (= scan
    chunk) boundaries: a cut inside a scan chunk changes its sums, so the same prompt cut by
    another budget would not give the same bits (tests/deploy/test_fast_rows_invariant.py)."""
    blocks, _ = _blocks(num_pages=16, recurrent=True, num_checkpoints=0, every=1)
    sched = Scheduler(blocks, max_batch_size=2, max_num_tokens=13, recurrent=recurrent)
    seq = _seq(range(10, 40))  # 30 tokens, pages of 4
    sched.add(seq)
    fed = []
    while seq.num_pending:
        (s,) = sched.schedule()
        s.seq.num_cached += s.num_tokens
        fed.append(s.num_tokens)
    assert fed == want


def test_a_prefill_that_cannot_reach_a_boundary_waits_a_step():
    """Budget 13, pages of 4 with a checkpoint every 2 (8 tokens): after a 12-token prefill
    uses the step, the next prompt is not started on the 1 token left (its chunks would all
    start off the boundaries); it starts next step, on a boundary."""
    blocks, _ = _blocks(num_pages=16, recurrent=True, num_checkpoints=8, every=2)
    sched = Scheduler(blocks, max_batch_size=2, max_num_tokens=13)
    a, b = _seq(range(10, 22)), _seq(range(50, 70))  # 12 and 20 tokens
    sched.add(a)
    sched.add(b)
    steps = []
    while a.num_pending or b.num_pending:
        batch = sched.schedule()
        for s in batch:
            s.seq.num_cached += s.num_tokens
        steps.append([(s.seq is a, s.num_tokens) for s in batch])
    assert steps == [[(True, 12)], [(False, 8)], [(False, 12)]]


def test_a_held_prefill_gets_a_page_next_step_while_decodes_fill_the_budget():
    """Three decodes leave 3 of a 6-token budget, pages of 4: the prefill beside them is held
    a step and then fed a whole page from budget kept for it (a decode waits a step), so every
    chunk starts and ends on a page boundary; nothing starves."""
    blocks = BlockManager(64, PS, 8, PrefixCache(64, PS, recurrent=True))
    sched = Scheduler(blocks, max_batch_size=8, max_num_tokens=6, recurrent=True)
    decodes = [Sequence([1, 2, 3, 4], SamplingParams(max_tokens=50), None) for _ in range(3)]
    b = _seq(range(50, 70))  # 20 tokens
    for s in (*decodes, b):
        sched.add(s)
    chunks, waits, last_fed = [], 0, {id(d): 0 for d in decodes}
    for step in range(40):
        batch = sched.schedule()
        assert sum(s.num_tokens for s in batch) <= 6
        for s in batch:
            if s.seq is b:
                chunks.append((b.num_cached, b.num_cached + s.num_tokens))
            else:
                waits = max(waits, step - last_fed[id(s.seq)])
                last_fed[id(s.seq)] = step
            s.seq.num_cached += s.num_tokens
            if s.seq.num_cached == len(s.seq):
                s.seq.output_ids.append(1)
        if not b.num_pending - 1 and len(b.output_ids):
            break
    assert chunks[-1][1] == 20, chunks
    assert all(start % PS == 0 and end % PS == 0 for start, end in chunks), chunks
    assert waits <= 2  # a decode waits one step at most
