"""Continuous batching with chunked prefill, page/slot allocation and preemption; requests in
arrival order (FCFS) or by priority (vLLM's `--scheduling-policy priority`)."""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from specdeploy.cache.prefix import NO_HIT, Hit, PrefixCache
from specdeploy.cache.window import WindowPages
from specdeploy.engine.request import Sequence, Status


class BlockManager:
    """Free lists of KV pages (`page_size` tokens each) and recurrent-state slots. With a
    `PrefixCache`, pages are reference-counted and cached ones stay until evicted (LRU) when the
    free list runs dry; `restores` collects the (state slot, checkpoint) copies that admitted
    hits need before the step's forward. `window`: the sliding-window layers' page group
    (cache/window.py), grown and freed alongside; its pages slide out (`slide`)."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int,
                 prefix: PrefixCache | None = None, window: WindowPages | None = None):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.free_pages = deque(range(num_pages))
        self.free_slots = deque(range(num_slots))
        self.prefix = prefix
        self.window = window
        self.restores: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        """Pages a sequence can get: free ones and cached ones nobody references."""
        return len(self.free_pages) + (len(self.prefix.evictable) if self.prefix else 0)

    def reset_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.free_pages.extend(self.prefix.clear())

    def match(self, seq: Sequence) -> Hit:
        # NOTE: a request owing prompt logprobs computes every position (prompt_logprobs.py)
        if self.prefix is None or seq.prompt_logprobs is not None:
            return NO_HIT
        return self.prefix.match(seq)

    def can_admit(self, seq: Sequence, hit: Hit, total_tokens: int) -> bool:
        """`seq` (its `num_cached` already set to the hit) can start with `hit` and grow."""
        if hit.empty:
            return self.can_grow(seq, total_tokens)
        extra = self.pages_for(total_tokens) - len(hit.pages)
        w = self.window
        return extra <= len(self.free_pages) + self.prefix.free_after_hit(hit) and (
            w is None or w.pages_for(total_tokens) - len(hit.win) <= w.free_after_hit(hit.win))

    def admit(self, seq: Sequence, hit: Hit) -> None:
        """Start `seq` (slot taken) on its cached pages; count the lookup."""
        if self.prefix is None:
            return
        self.prefix.take(hit, seq)
        seq.pages = list(hit.pages)
        seq.num_offered_pages = hit.num_pages
        seq.num_cached = hit.num_pages * self.page_size
        if hit.checkpoint >= 0:
            self.restores.append((seq.slot, hit.checkpoint))

    def pages_for(self, num_tokens: int) -> int:
        # NOTE: a model without attention (Mamba2 / MLP only) has no KV pages: it needs none
        # (it waited for them for ever before)
        return -(-num_tokens // self.page_size) if self.num_pages else 0

    def extra_pages(self, seq: Sequence, total_tokens: int) -> int:
        return max(0, self.pages_for(total_tokens) - len(seq.pages))

    def can_grow(self, seq: Sequence, total_tokens: int) -> bool:
        return self.can_grow_all([(seq, total_tokens)])

    def can_grow_all(self, wants: list[tuple[Sequence, int]]) -> bool:
        """Whether every (sequence, total tokens) can grow at once, in both page groups."""
        w = self.window
        return sum(self.extra_pages(s, t) for s, t in wants) <= self.num_free and (
            w is None or sum(w.extra(s, t) for s, t in wants) <= w.num_free)

    def slide(self, seqs) -> None:
        """Free the window-group pages the sequences' future queries cannot see."""
        if self.window is not None:
            for seq in seqs:
                self.window.slide(seq)

    def grow(self, seq: Sequence, total_tokens: int) -> None:
        if self.window is not None:
            self.window.grow(seq, total_tokens)
        for _ in range(self.extra_pages(seq, total_tokens)):
            if self.prefix is None:
                seq.pages.append(self.free_pages.popleft())
            elif self.free_pages:
                seq.pages.append(self.free_pages.popleft())
                self.prefix.new_page(seq.pages[-1])
            else:
                seq.pages.append(self.prefix.evict())

    def take_slot(self, seq: Sequence) -> None:
        seq.slot = self.free_slots.popleft()

    def free(self, seq: Sequence) -> None:
        if self.prefix is None:
            # NOTE: reused first, in order: a CPU KV cache is backed as pages are first
            # written (cache/handlers.py lazy_zeros), so memory stays at the peak in use
            self.free_pages.extendleft(reversed(seq.pages))
        else:  # tail first: a prefix's later pages are evicted before its first ones
            self.free_pages.extend(p for p in reversed(seq.pages) if self.prefix.release(p))
        seq.pages = []
        if self.window is not None:
            self.window.release_all(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
        seq.slot = -1


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step: all_ids[num_cached : num_cached + num_tokens]

    @property
    def samples(self) -> bool:
        """Whether this step's logits produce the sequence's next token (prefill done)."""
        return self.seq.num_cached + self.num_tokens == len(self.seq)


POLICIES = ("fcfs", "priority")


class Scheduler:
    """Each step: running sequences first (oldest first), then waiting ones in arrival order,
    within a budget of `max_num_tokens` fed tokens. A prompt longer than the remaining budget is
    fed in chunks over several steps.

    `policy` "priority" (vLLM's): the same, ordered by (`seq.priority`, arrival) instead of by
    arrival alone, lower first: the waiting queue and the running list both keep that order,
    so a step serves the most urgent sequences first and a cache too full to grow them
    preempts the least urgent (the newest of the lowest priority). A request that waits does
    not preempt running ones (as vLLM): it takes the next free place.

    `lookahead` is the number of extra cache positions a decoding sequence reserves beyond its
    fed tokens (speculative drafts use it); 0 for plain decoding.
    """

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_tokens: int,
                 lookahead: int = 0, recurrent: bool = False):
        self.blocks = blocks
        self.max_batch_size = min(max_batch_size, blocks.num_slots)
        self.max_num_tokens = max_num_tokens
        self.lookahead = lookahead
        # NOTE: a prefill cut by the budget ends on a checkpointed boundary, so the next chunk
        # starts on one too: scans chunk from a segment's start, and with pages of the scan
        # chunk every checkpoint is then a chunk end whose state comes free (ops/scan_states.py)
        p = blocks.prefix
        self.align = (blocks.page_size * p.checkpoint_every
                      if p is not None and p.recurrent and p.num_checkpoints else 1)
        # and failing that on a page boundary, prefix caching or not: a cut inside a scan chunk
        # changes the scan's sums (fp32 rounding, ~5e-6 in the logits; the fast kernels' 8-bit
        # activations make that ~5e-2), so a prompt cut where a busier step left room would
        # not give the bits it gives cut elsewhere; on chunk boundaries every cut gives the same
        self.chunk_align = blocks.page_size if recurrent else 1
        self._held: set[int] = set()  # ids of prefills held back this step (at most one step)
        self._held_last: set[int] = set()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order (policy "priority": by key)
        self.num_preemptions = 0
        self.policy = "fcfs"

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {', '.join(POLICIES)}, got "
                             f"{policy!r}")
        if self.has_work():
            raise ValueError("scheduling_policy: cannot change with requests in flight")
        self.policy = policy

    @staticmethod
    def _key(seq: Sequence) -> tuple[int, int]:
        return seq.priority, seq.arrival

    def _insert(self, queue, seq: Sequence) -> None:
        """Into `queue` (kept in key order) after every sequence of a smaller or equal key."""
        queue.insert(bisect.bisect_right([self._key(s) for s in queue], self._key(seq)), seq)

    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._insert(self.waiting, seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _want(self, seq: Sequence, budget: int) -> int:
        """Tokens to feed `seq` this step; 0: wait for a step with room to reach a boundary
        (a chunk starting off the boundaries would put every later one inside a scan chunk);
        never two steps running, so a prefill next to busy decodes is not starved."""
        n = min(seq.num_pending, budget)
        if n < seq.num_pending and seq.mm is not None:
            # NOTE: a chunk ends before a bidirectional image block it would cut (Gemma 3), or
            # when the block starts the chunk, after it, past the budget if need be: a block's
            # keys must all be cached when its first token attends (ops/cached_attention.py)
            n = seq.mm.chunk_tokens(seq.num_cached, n)
        if n < seq.num_pending and max(self.align, self.chunk_align) > 1:
            for unit in (self.align, self.chunk_align):
                end = (seq.num_cached + n) // unit * unit
                if unit > 1 and end > seq.num_cached:
                    return end - seq.num_cached
            unit = min(u for u in (self.align, self.chunk_align) if u > 1)
            if self.max_num_tokens >= unit and id(seq) not in self._held_last:
                self._held.add(id(seq))
                n = 0
        return n

    def _reserved(self) -> int:
        """Budget kept this step for the prefills held back last step: enough to reach their
        next page boundary, so the step after a hold cuts on one too (the sequences before
        them in the step, decodes included, wait a step if the rest cannot hold them)."""
        unit = min((u for u in (self.align, self.chunk_align) if u > 1), default=1)
        if unit == 1 or not self._held_last:
            return 0
        total = 0
        for seq in (*self.running, *self.waiting):
            if id(seq) in self._held_last and seq.num_pending:
                total += min(seq.num_pending, unit - seq.num_cached % unit)
        return total if total <= self.max_num_tokens else 0

    def _reserve(self, seq: Sequence, n: int) -> int:
        """Cache positions a step feeding `n` tokens needs (drafts reserve `lookahead` more):
        also after a prefill chunk that leaves one prompt token, as the engine drafts after it
        (the next step verifies that token with drafts) and a drafter's chain writes its KV at
        the positions past the chunk (speculative.py `_after_step`: `wants`)."""
        total = seq.num_cached + n
        return total + self.lookahead if total >= len(seq) - 1 else total

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_tokens
        self._held_last, self._held = self._held, set()
        reserved = self._reserved()
        out: list[ScheduledSeq] = []
        preempted_before = self.num_preemptions
        self.blocks.slide(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            held = id(seq) in self._held_last
            room = budget if held else budget - reserved
            n = self._want(seq, room) if room > 0 else 0
            if n > room and reserved and not held:  # a verify segment is fed whole: it
                n = 0                                 # waits rather than eat the reservation
            if n == 0:
                i += 1
                continue
            if held:
                reserved -= min(reserved, n)
            need = self._reserve(seq, n)
            while not self.blocks.can_grow(seq, need) and self.running[-1] is not seq:
                self.preempt(self.running[-1])
            if not self.blocks.can_grow(seq, need):
                self.preempt(seq)  # it is the newest: it yields to the older ones
                break
            self.blocks.grow(seq, need)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # After a preemption the cache is tight: admitting now would only thrash.
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch_size
               and self.blocks.free_slots and self.num_preemptions == preempted_before):
            seq = self.waiting[0]
            hit = self.blocks.match(seq)  # cached prefix pages: their tokens are not fed
            seq.num_cached = hit.num_pages * self.blocks.page_size
            n = self._want(seq, budget)
            need = self._reserve(seq, n)
            if n == 0 or not self.blocks.can_admit(seq, hit, need):
                seq.num_cached = 0
                break  # FCFS: later requests do not overtake the head of the queue
            self.waiting.popleft()
            self.blocks.take_slot(seq)
            self.blocks.admit(seq, hit)
            self.blocks.grow(seq, need)
            seq.status = Status.RUNNING
            if self.policy == "priority":
                self._insert(self.running, seq)
            else:
                self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def preempt(self, seq: Sequence) -> None:
        """Free everything; the sequence is recomputed later as a prefill of prompt + output."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":  # (ahead of later arrivals of its priority)
            self._insert(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED


class SpecScheduler(Scheduler):
    """A drafting sequence feeds its whole extend segment at once and reserves room for the
    drafter's next positions."""

    def _want(self, seq: Sequence, budget: int) -> int:
        return 1 + len(seq.spec.drafts) if seq.spec.drafts else super()._want(seq, budget)

    def _reserve(self, seq: Sequence, n: int) -> int:
        if seq.spec.drafts:
            return seq.num_cached + n + self.lookahead - 1
        return super()._reserve(seq, n)

    def preempt(self, seq: Sequence) -> None:
        seq.spec.clear()  # recomputed from scratch with the prefill
        seq.spec.behind = None
        super().preempt(seq)


def block_manager(layout) -> BlockManager:
    """The engine's pages and slots for a deployment's `CacheLayout`, with its prefix cache
    (when on; by KV page: a model without attention has none to key it on) and its window
    page group (when the graph has one)."""
    window = (WindowPages(layout.num_win_pages, layout.page_size, layout.window)
              if getattr(layout, "num_win_pages", 0) else None)
    prefix = None
    if getattr(layout, "prefix_caching", False) and (layout.num_pages or window is not None):
        prefix = PrefixCache(layout.num_pages, layout.page_size, recurrent=layout.recurrent,
                             num_checkpoints=layout.num_checkpoints,
                             checkpoint_every=layout.checkpoint_every, window=window)
    return BlockManager(layout.num_pages, layout.page_size, layout.num_slots, prefix, window)
