"""The sliding-window page group's bookkeeping (cache/window.py, BlockManager, the plan): pages
that slid out of every future query's window go back to the pool (never one a query can still
read), a prefix hit needs the window's pages before its end, and the plan's split of one budget
holds more sequences than one group of full-context pages. Host only: no model (end to end:
tests/engine/test_window_pages.py)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.handlers import PagedKV
from specdeploy.cache.plan import plan_cache
from specdeploy.cache.prefix import PrefixCache
from specdeploy.cache.window import NULL_PAGE, WindowPages
from specdeploy.engine.request import SamplingParams, Sequence
from specdeploy.engine.scheduler import BlockManager

PS, W = 4, 8  # two pages of window


def _seq(ids):
    return Sequence(list(ids), SamplingParams(max_tokens=4), None)


def _blocks(num_pages=64, num_win=16, prefix=False):
    win = WindowPages(num_win, PS, W)
    cache = PrefixCache(num_pages, PS, window=win) if prefix else None
    return BlockManager(num_pages, PS, 4, cache, win), win


def _advance(blocks, seq, total):
    """Grow to `total` tokens, 'compute' them, then slide (as the next schedule does)."""
    blocks.grow(seq, total)
    seq.num_cached = total
    if blocks.prefix is not None:
        blocks.prefix.register(seq, total)
    blocks.slide([seq])


@pytest.mark.parametrize("q_min", range(0, 40))
def test_a_freed_page_lies_wholly_before_every_future_querys_window(q_min):
    win = WindowPages(64, PS, W)
    first = win.first_live(q_min)
    # the oldest key a query at q_min (or later) reads is q_min - W + 1
    assert first * PS <= max(0, q_min - W + 1)
    assert first == 0 or first * PS > q_min - W - PS  # and no page is kept needlessly long


def test_pages_slide_out_and_the_pool_stays_at_the_window():
    blocks, win = _blocks()
    seq = _seq(range(100))
    blocks.take_slot(seq)
    used = []
    for total in range(1, 101):
        _advance(blocks, seq, total)
        used.append(win.in_use)
        live = [i for i, p in enumerate(seq.win_pages) if p != NULL_PAGE]
        assert live and live[0] == win.first_live(total)
        assert live == list(range(live[0], live[0] + len(live)))
    assert max(used) <= W // PS + 2 and win.slid == 25 - win.in_use
    assert len(seq.pages) == 25  # the full-context group keeps every page
    blocks.free(seq)
    assert win.in_use == 0 and len(win.free) == 16 and NULL_PAGE not in win.free


def test_speculative_lookahead_and_a_rollback_keep_the_committed_window():
    blocks, win = _blocks()
    seq = _seq(range(60))
    blocks.take_slot(seq)
    _advance(blocks, seq, 30)
    blocks.grow(seq, 30 + 1 + 4)  # a verify segment: the last token and 4 drafts
    assert all(p != NULL_PAGE for p in seq.win_pages[win.first_live(30):])
    seq.num_cached = 31  # one accepted: the drafts' positions roll back
    blocks.slide([seq])
    # every key a query at 31.. can read (24..) is still on a live page
    assert all(seq.win_pages[i] != NULL_PAGE for i in range(24 // PS, len(seq.win_pages)))


def test_admission_counts_the_window_group():
    blocks, win = _blocks(num_pages=64, num_win=3)
    a = _seq(range(40))
    blocks.take_slot(a)
    assert not blocks.can_grow(a, 16)  # 4 window pages at once: the group holds 3
    assert blocks.can_grow(a, 12)
    _advance(blocks, a, 12)
    _advance(blocks, a, 16)  # one more page, while the oldest slid out
    assert win.in_use == 3 - len(win.free) and blocks.can_grow_all([(a, 20)])


def test_a_prefix_hit_needs_the_window_before_its_end():
    blocks, win = _blocks(prefix=True)
    a = _seq(range(10, 50))  # 40 tokens: 10 full pages
    blocks.take_slot(a)
    for total in range(4, 41, 4):
        _advance(blocks, a, total)
    assert win.first_live(40) == 8 and len(win.key_of) == 10  # registered before sliding
    blocks.free(a)  # cached window pages stay (evictable), the rest go back
    b = _seq(list(range(10, 46)) + [1, 2, 3])
    hit = blocks.match(b)
    assert hit.num_pages == 9 and hit.pages == a_pages(blocks, 9)
    assert hit.win[:win.first_live(36)] == [NULL_PAGE] * win.first_live(36)
    assert all(p != NULL_PAGE for p in hit.win[win.first_live(36):])
    blocks.take_slot(b)
    blocks.admit(b, hit)
    assert b.num_cached == 36 and b.win_pages == hit.win and b.win_first == 7
    # evict every cached window page: the full pages alone no longer make a hit
    c = _seq(range(10, 50))
    blocks.free(b)
    blocks.take_slot(c)
    win.grow(c, len(win.free) * PS + len(win.evictable) * PS)
    assert not win.page_of and blocks.match(_seq(list(range(10, 46)) + [7])).empty


def a_pages(blocks, n):
    return [blocks.prefix.page_of[k] for k in blocks.prefix.keys(_seq(range(10, 50)), n)]


def test_all_windowed_hits_need_no_full_pages():
    win = WindowPages(32, PS, W)
    prefix = PrefixCache(0, PS, window=win)
    blocks = BlockManager(0, PS, 4, prefix, win)
    a = _seq(range(10, 50))
    blocks.take_slot(a)
    for total in range(4, 41, 4):
        _advance(blocks, a, total)
    assert a.pages == [] and win.in_use <= W // PS + 2
    hit = blocks.match(_seq(list(range(10, 50)) + [3]))
    assert hit.pages == [] and hit.num_pages == 10 and hit.win[-2:] == a.win_pages[-2:]


def _kv(name, window=0):
    return PagedKV(name, 2, 16, 16, torch.float32, window=window)


def test_the_plan_splits_one_budget_and_holds_more_sequences():
    full = [_kv(f"kv_cache_{i}") for i in range(4)]
    mixed = [_kv("kv_cache_0", W), _kv("kv_cache_1"), _kv("kv_cache_2", W), _kv("kv_cache_3")]
    gib = 400_000 / 2**30
    args = dict(page_size=PS, max_batch_size=16, max_seq_len=128, max_cache_gib=gib,
                device=torch.device("cpu"))
    a, b = plan_cache(full, **args), plan_cache(mixed, **args)
    assert a.num_win_pages == 0 and b.num_win_pages > 0 and b.window == W
    assert a.total_bytes <= a.budget_bytes and b.total_bytes <= b.budget_bytes
    assert b.bytes_by_handler["kv_cache_0"] == 2 * 16 * 2 * 4 * 4 * (b.num_win_pages + 2)
    assert "sliding-window group: 2 layer(s), window 8" in b.summary()

    def fits(plan):  # decoding sequences of 120 tokens held at once
        win = WindowPages(plan.num_win_pages, PS, W) if plan.num_win_pages else None
        blocks, n = BlockManager(plan.num_pages, PS, 16, None, win), 0
        while True:
            seq = _seq(range(120))
            blocks.take_slot(seq)
            for total in range(8, 121, 8):
                if not blocks.can_grow(seq, total):
                    return n
                _advance(blocks, seq, total)
            n += 1

    assert fits(b) > fits(a) >= 2
    assert fits(a) == a.num_pages // 30
