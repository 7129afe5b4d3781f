"""The sliding-window page group (vLLM's hybrid KV cache manager, for windowed layers).

A layer with a window of W keys (Gemma 3's local layers, gpt-oss' alternate layers, Mistral)
never reads a key more than W - 1 positions before its query. Its paged KV is a group of its
own (`PagedKV.window`, deploy/passes/insert_cache.py `window_kv_pages`): its own pool, sized by
cache/plan.py from the one budget, and its own block table (`page_table_win`), indexed by page
index like the full-context table. Once every query a sequence can still issue lies at or past
`q_min`, its page j with (j + 1) * page_size <= q_min - W is never read again: it goes back to
the pool and its slot in the table becomes the null page.

`q_min` is the sequence's committed length (`num_cached`): every later step feeds positions
from there on (the rest of a chunked prefill, a decode token, the last accepted token and its
drafts, a decode burst's tokens), and a rejected draft only rolls back to the committed length,
whose window the pages kept still cover. Pages are freed when the scheduler next looks at the
sequence (`BlockManager.slide`), never during a step.

The null page (id 0) is never handed out and never written (the scratch page, past the pool,
takes the padding rows of replayed graphs), so it stays zero: a freed or padding slot read by a
kernel that gathers whole tables (the torch decode / verify paths, a CUDA graph's fixed width)
reads finite zeros whose scores its window mask drops, never another sequence's page or a NaN.

Prefix caching: a full page of committed tokens registers here under the same chained key as
its full-context page. A hit of L = n pages needs this group's pages covering [L - W, L) (the
first new query's window), so `match` takes the longest n whose full-context pages are all
cached and whose window pages from `first_live(L)` on are; a hit's slots before those are null.
"""
from __future__ import annotations

from collections import OrderedDict, deque

NULL_PAGE = 0


class WindowPages:
    """Pool (pages 1..num_pages), reference counts and, with prefix caching, the cached pages
    of the window group. Per sequence: `seq.win_pages` (the block table row) and
    `seq.win_first` (slots before it are null)."""

    def __init__(self, num_pages: int, page_size: int, window: int):
        self.num_pages, self.page_size, self.window = num_pages, page_size, window
        self.free = deque(range(1, num_pages + 1))
        self.ref = [0] * (num_pages + 1)
        self.key_of: dict[int, bytes] = {}  # registered page -> key
        self.page_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; LRU
        self.slid = 0  # pages returned as they slid out of a window (stats, tests)

    def first_live(self, q_min: int) -> int:
        """Index of the first page a query at `q_min` or later may read."""
        return max(0, (q_min - self.window) // self.page_size)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def in_use(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra(self, seq, total_tokens: int) -> int:
        return max(0, self.pages_for(total_tokens) - len(seq.win_pages))

    def grow(self, seq, total_tokens: int) -> None:
        for _ in range(self.extra(seq, total_tokens)):
            if self.free:
                page = self.free.popleft()
            else:  # the least recently used cached page nobody holds
                page, _ = self.evictable.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.ref[page] = 1
            seq.win_pages.append(page)

    def _release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] > 0:
            return
        if page in self.key_of:
            self.evictable[page] = None
        else:  # NOTE: reused first: a CPU cache is backed as its pages are first written
            self.free.appendleft(page)

    def slide(self, seq) -> None:
        """Return the pages of `seq` that no query from its committed length on can read."""
        pages = seq.win_pages
        end = min(self.first_live(seq.num_cached), len(pages))
        for i in range(seq.win_first, end):
            if pages[i] != NULL_PAGE:
                self._release(pages[i])
                pages[i] = NULL_PAGE
                self.slid += 1
        seq.win_first = max(seq.win_first, end)

    def release_all(self, seq) -> None:
        for page in reversed(seq.win_pages):
            if page != NULL_PAGE:
                self._release(page)
        seq.win_pages = []
        seq.win_first = 0

    # ---- prefix caching (cache/prefix.py calls these) ----------------------------------------
    def hit_pages(self, keys: list[bytes], n: int) -> list[int] | None:
        """The block-table row of a hit of `n` pages (nulls, then the cached pages covering
        the first new query's window), or None when a page it needs is not cached."""
        first = self.first_live(n * self.page_size)
        row = [NULL_PAGE] * first
        for key in keys[first:n]:
            page = self.page_of.get(key)
            if page is None:
                return None
            row.append(page)
        return row

    def free_after_hit(self, row: list[int]) -> int:
        return self.num_free - sum(p in self.evictable for p in row if p != NULL_PAGE)

    def take(self, seq, row: list[int]) -> None:
        for p in row:
            if p != NULL_PAGE:
                self.ref[p] += 1
                self.evictable.pop(p, None)
        seq.win_pages = list(row)
        seq.win_first = next((i for i, p in enumerate(row) if p != NULL_PAGE), len(row))

    def register(self, seq, first: int, last: int, keys: list[bytes]) -> None:
        """Cache the sequence's live pages first..last-1 (full of committed tokens)."""
        pages = seq.win_pages
        for i in range(first, min(last, len(pages))):
            page, key = pages[i], keys[i]
            if page == NULL_PAGE or key in self.page_of or page in self.key_of:
                continue
            self.page_of[key] = page
            self.key_of[page] = key

    def clear(self) -> None:
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.key_of.clear()
        self.page_of.clear()
