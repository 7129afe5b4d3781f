"""Automatic prefix caching: full KV pages keyed by a chained hash of their tokens, shared
read-only between sequences by reference count, LRU-evicted when free pages run out; recurrent
layers add a checkpoint of their states at (some) page boundaries.

A page is *registered* once every token in it is committed (prefill chunk done, decode token
sampled, speculative run accepted): its key is hash(key of the page before, its tokens), so a
key names the whole prefix up to the end of that page. A later sequence whose tokens start with
the same pages takes them (reference +1) and starts its prefill after them. Nothing ever writes a
registered page again: a sequence only writes positions >= its `num_cached`, and a page is
registered only when all its positions are below that.

Recurrent states (Mamba2 SSM, conv windows, gated delta) cannot be sliced out of pages: a hit on
a hybrid model must also restore every recurrent layer's state *at the hit boundary*, so it ends
at the last matched page that has a checkpoint (the states after its last token, written by the
cached ops while they prefill across the boundary, or copied from the verify step's spec states
for committed tokens only). Checkpoints live in their own pool (`Checkpoint` resources, sized by
cache/plan.py) with their own LRU; dropping one never touches a running sequence (a checkpoint is
read only when a sequence is admitted). This module is host bookkeeping only; the engine does the
tensor copies (`restore_states`, `checkpoint_spec` of the deployed program).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import NamedTuple

import torch

ROOT = b"specdeploy-prefix-v1"  # the key "before" the first page


def page_key(prev: bytes, tokens, extra: bytes = b"") -> bytes:
    """Chained key of one full page. `extra` keys non-token inputs of the page (images later).
    NOTE: a 128-bit digest, not Python's hash(): a collision would silently serve another
    prompt's KV."""
    return hashlib.blake2b(prev + extra + array("q", tokens).tobytes(), digest_size=16).digest()


def root_key(seq) -> bytes:
    """The key before a sequence's first page: ROOT for text; for a prompt with images, ROOT
    chained with the images' pixels and grids, since every image is the same run of
    placeholder tokens and two images must never share KV."""
    mm = getattr(seq, "mm", None)
    if mm is None:
        return ROOT
    h = hashlib.blake2b(ROOT, digest_size=16)
    h.update(mm.pixel_values.detach().float().contiguous().cpu().numpy().tobytes())
    h.update(array("q", torch.as_tensor(mm.grid_thw).flatten().tolist()).tobytes())
    return h.digest()


class Hit(NamedTuple):
    pages: list[int]  # cached pages the sequence starts with
    checkpoint: int  # checkpoint slot to restore the recurrent states from, -1: none needed
    win: list[int] = []  # the window group's block-table row (cache/window.py), or []

    @property
    def num_pages(self) -> int:
        """Pages of prompt the hit covers (the full group's, or the window row's length)."""
        return max(len(self.pages), len(self.win))

    @property
    def empty(self) -> bool:
        return not self.num_pages


NO_HIT = Hit([], -1)


class PrefixCache:
    """Page reference counts, registered pages, the LRU of unreferenced cached pages, and the
    checkpoint pool's slots. `recurrent`: the model has recurrent states, so a hit must end on a
    checkpointed page; `num_checkpoints` slots, one every `checkpoint_every` pages at most."""

    def __init__(self, num_pages: int, page_size: int, *, recurrent: bool = False,
                 num_checkpoints: int = 0, checkpoint_every: int = 1, window=None):
        self.page_size = page_size
        self.window = window  # cache/window.py WindowPages: the window group's cached pages
        self.full = num_pages > 0  # (a model whose every layer is windowed has no full pages)
        self.recurrent = recurrent
        self.checkpoint_every = checkpoint_every
        self.num_checkpoints = num_checkpoints
        self.ref = [0] * num_pages
        self.key_of: dict[int, bytes] = {}  # registered page -> key
        self.page_of: dict[bytes, int] = {}  # key -> registered page
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref 0; LRU first
        self.ckpt_of: dict[int, int] = {}  # registered page -> checkpoint slot
        self.ckpt_lru: OrderedDict[int, int] = OrderedDict()  # checkpoint slot -> page
        self.free_ckpts = deque(range(num_checkpoints))
        self.pending: dict[tuple[int, int], int] = {}  # (id(seq), page index) -> slot
        self.queries = 0  # tokens looked up (vllm:prefix_cache_queries_total)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits_total)
        self.evicted_pages = 0

    # ---- keys -------------------------------------------------------------------------------
    def keys(self, seq, num_pages: int) -> list[bytes]:
        """Keys of the sequence's first `num_pages` full pages (memoized on the sequence: its
        tokens never change once appended)."""
        keys, ids, ps = seq.page_keys, None, self.page_size
        while len(keys) < num_pages:
            ids = seq.all_ids if ids is None else ids
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else root_key(seq), ids[i * ps:(i + 1) * ps]))
        return keys[:num_pages]

    # ---- lookup -----------------------------------------------------------------------------
    def match(self, seq) -> Hit:
        """The longest run of cached pages the sequence starts with (at least its last token is
        left to feed: its logits are needed), cut back to a checkpointed page if recurrent."""
        pages = []
        keys = self.keys(seq, (len(seq) - 1) // self.page_size)
        for key in keys if self.full else ():
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        if self.window is None:
            if not self.recurrent:
                return Hit(pages, -1)
            while pages and pages[-1] not in self.ckpt_of:
                pages.pop()
            return Hit(pages, self.ckpt_of[pages[-1]]) if pages else NO_HIT
        # NOTE: the window group must also hold the pages of the first new query's window
        for n in range(len(pages) if self.full else len(keys), 0, -1):
            if self.recurrent and pages[n - 1] not in self.ckpt_of:
                continue
            row = self.window.hit_pages(keys, n)
            if row is not None:
                return Hit(pages[:n], self.ckpt_of[pages[n - 1]] if self.recurrent else -1, row)
        return NO_HIT

    def free_after_hit(self, hit: Hit) -> int:
        """Cached-but-unreferenced pages that stay evictable once `hit` is taken."""
        return len(self.evictable) - sum(p in self.evictable for p in hit.pages)

    def take(self, hit: Hit, seq) -> None:
        """`seq` starts with `hit` (counts the query)."""
        for p in hit.pages:
            self.ref[p] += 1
            self.evictable.pop(p, None)
        if self.window is not None:
            self.window.take(seq, hit.win)
        if hit.checkpoint >= 0:
            self.ckpt_lru.move_to_end(hit.checkpoint)
        self.queries += len(seq)
        self.hits += hit.num_pages * self.page_size

    # ---- page lifetime ----------------------------------------------------------------------
    def new_page(self, page: int) -> None:
        self.ref[page] = 1

    def release(self, page: int) -> bool:
        """Drop one reference; True when the page is free for reuse (not cached)."""
        self.ref[page] -= 1
        if self.ref[page] > 0:
            return False
        if page in self.key_of:
            self.evictable[page] = None  # most recently used last
            return False
        return True

    def evict(self) -> int | None:
        """Reuse the least recently used unreferenced cached page (its key and checkpoint go)."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        slot = self.ckpt_of.pop(page, None)
        if slot is not None:
            del self.ckpt_lru[slot]
            self.free_ckpts.append(slot)
        self.evicted_pages += 1
        self.ref[page] = 1
        return page

    def register(self, seq, num_committed: int) -> None:
        """Offer the sequence's pages that are full of committed tokens to the cache. A page
        whose key is already cached (two sequences computed the same prefix) stays private."""
        first, last = seq.num_offered_pages, num_committed // self.page_size
        if last <= first:
            return
        keys = self.keys(seq, last)
        if self.window is not None:
            self.window.register(seq, first, last, keys)
        for i in range(first, min(last, len(seq.pages))):
            page, key = seq.pages[i], keys[i]
            slot = self.pending.pop((id(seq), i), None)
            if key in self.page_of or page in self.key_of:
                if slot is not None:
                    self.free_ckpts.append(slot)
                continue
            self.page_of[key] = page
            self.key_of[page] = key
            if slot is not None:
                self.ckpt_of[page] = slot
                self.ckpt_lru[slot] = page
        seq.num_offered_pages = last

    # ---- checkpoints ------------------------------------------------------------------------
    def boundaries(self, start: int, n: int) -> list[int]:
        """Checkpointed page boundaries b (tokens before it) with start < b <= start + n."""
        if not (self.recurrent and self.num_checkpoints):
            return []
        step = self.page_size * self.checkpoint_every
        first = (start // step + 1) * step
        return list(range(first, start + n + 1, step))

    def take_checkpoint(self, seq, boundary: int) -> int | None:
        """A slot for the states at `boundary` of `seq`, attached to its page when the page
        registers (`register`), or freed at `end_step`. None: the pool is all pending."""
        if self.free_ckpts:
            slot = self.free_ckpts.popleft()
        elif self.ckpt_lru:
            slot, page = self.ckpt_lru.popitem(last=False)
            del self.ckpt_of[page]
        else:
            return None
        self.pending[(id(seq), boundary // self.page_size - 1)] = slot
        return slot

    def end_step(self) -> None:
        """Checkpoints written for pages that did not register (finished, duplicate) go back."""
        self.free_ckpts.extend(self.pending.values())
        self.pending.clear()

    def clear(self) -> list[int]:
        """Forget every cached page and checkpoint (vLLM's reset_prefix_cache); pages still
        referenced stay with their sequences as private pages. Returns the pages now free."""
        freed = list(self.evictable)
        if self.window is not None:
            self.window.clear()
        self.key_of.clear()
        self.page_of.clear()
        self.evictable.clear()
        self.ckpt_of.clear()
        self.ckpt_lru.clear()
        pending = set(self.pending.values())
        self.free_ckpts = deque(s for s in range(self.num_checkpoints) if s not in pending)
        return freed

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_pages": len(self.key_of),
                "prefix_cache_evicted_pages": self.evicted_pages,
                "checkpoint_slots": self.num_checkpoints,
                "checkpoints_used": len(self.ckpt_lru)}
