"""N-gram lookup drafts ("prompt lookup"): continue the sequence the way it went the last time
its final n tokens occurred.

Small chat models repeat themselves (lists, code, loops), and what followed an earlier
occurrence of the last few tokens is then a far better guess than a one-layer drafter's:
on SmolLM2-135M-Instruct's own greedy replies it fires at 46% of positions and gets 2.1 of 3
drafts accepted there (`bench/copy_predictability.py --lookup`). The engine uses these drafts
instead of the drafter's when they exist; the verification is unchanged, so output stays exact.
"""
from __future__ import annotations

import torch

from specdeploy.engine.suffix_store import MAX_N as STORE_N

COPY_CAP = 64  # longest copy length `NgramIndex.propose` measures


class NgramIndex:
    """Per-sequence index: n-gram (n in min_n..max_n) → position right after its latest
    occurrence. Built incrementally; a sequence's tokens only ever grow."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.table: dict[tuple[int, ...], int] = {}
        self.done = 0  # n-grams ending before this position (with a known successor) indexed
        self.copied = 0  # the last match's copy length (`propose`)

    def propose(self, ids: list[int], k: int, drafts: list[int] = ()) -> list[int] | None:
        """K tokens to follow `ids + drafts`, or None when no suffix of it of length
        max_n..min_n occurred in `ids` before (with its next token also in `ids`: the committed
        tokens; `drafts` are not real yet and are never indexed). The longest matching suffix
        wins, its latest occurrence first. A continuation that runs into the suffix itself
        repeats with the match's period (a loop stays a loop).

        Sets `copied`: how many tokens the tail agrees with the text before the occurrence it
        copies (the matched n-gram and further back, up to COPY_CAP): a copy that has held for
        30 tokens holds on far more often than one of 2 (the cost controller's evidence,
        engine/spec_control.py)."""
        n_ids = len(ids)
        for end in range(max(self.done, 1), n_ids):  # index n-grams ending at end-1
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.table[tuple(ids[end - n:end])] = end
        self.done = max(self.done, n_ids)
        # NOTE: only the tail is copied; this runs every draft step of every sequence
        drafts = list(drafts)
        tail = list(ids[-self.max_n:]) + drafts
        n_full = n_ids + len(drafts)
        for n in range(min(self.max_n, n_full - 1), self.min_n - 1, -1):
            j = self.table.get(tuple(tail[len(tail) - n:]))
            if j is None:
                continue
            # NOTE: slices and zip, not token-by-token indexing: a copy of 64 tokens measured
            # ~10 us that way, every draft step of every sequence
            period = n_full - j  # token x before the occurrence meets token x + period
            lo = max(j - COPY_CAP, 0)
            ahead = list(ids[lo + period:]) + drafts if lo + period < n_ids else \
                drafts[lo + period - n_ids:]
            c = n
            for u, v in zip(reversed(ids[lo:j - n]), reversed(ahead[:j - n - lo])):
                if u != v:
                    break
                c += 1
            self.copied = c
            out = list(ids[j:j + k])  # (j < n_ids: only committed tokens are indexed)
            if len(out) < k:
                out += drafts[:k - len(out)]
            for i in range(len(out), k):  # past the end: the match's period repeats
                out.append(out[i - period])
            return out
        return None


def next_lookup_len(n: int, all_accepted: bool, k: int, cap: int) -> int:
    """How many drafts a sequence's next lookup match makes, after a lookup step that drafted
    up to `n`: twice as many (up to `cap`) when every draft was accepted, else back to `k`.

    A loop that held for all n drafts tends to hold on, and lookup drafts cost no drafter steps;
    but on a CPU verify rows past the fourth cost more (the linears leave the W @ x^T path:
    bench/linear_rows.py), so long runs are kept for matches that have held. Against lookup runs
    of K on SmolLM2-135M: README, "N-gram lookup drafts"."""
    return min(2 * n, cap) if all_accepted else k


class Lookup:
    """N-gram lookup as a draft source's helper: (max n, min n) and how long its runs may grow
    (`max_k`, from K). Completes a sequence's drafts from an earlier occurrence of its tail.

    Lookup drafts are deterministic given the prefix, so for a sampled request q is one-hot on
    each (rejection sampling then accepts d with probability p(d) and otherwise resamples from p
    without d): the output still follows the target."""

    def __init__(self, max_n: int, min_n: int, k: int, max_k: int, store=None):
        self.max_n, self.min_n, self.k, self.max_k = max_n, min_n, k, max_k
        # where the sequence itself has no match: the suffix store's (engine/suffix_store.py)
        self.store = store
        self.controller = None  # the cost controller, which may skip asking the store
        # with the cost controller every match drafts `max_k` and the controller cuts the run
        # to what pays (engine/spec_control.py); without it runs grow as `next_lookup_len` says
        self.longest = False

    def complete(self, seq, ids: list[int], vocab_size: int, device) -> bool:
        """Extend `seq.spec.drafts` to the sequence's lookup length when its committed tokens
        `ids` plus its drafts so far end in an n-gram seen before; True if it did."""
        st = seq.spec
        if st.ngram_index is None or (st.ngram_index.max_n, st.ngram_index.min_n) != (
                self.max_n, self.min_n):
            st.ngram_index = NgramIndex(self.max_n, self.min_n)
        n = self.max_k if self.longest else min(st.lookup_n or self.k, self.max_k)
        if n <= len(st.drafts):
            return False
        rest = st.ngram_index.propose(ids, n - len(st.drafts), st.drafts)
        conf = None
        if rest is None:
            if self.store is None or (self.controller is not None
                                      and not self.controller.wants_store(seq)):
                return False
            # NOTE: a store chain stops where its estimate falls below the store's min_prob
            rest, conf = self.store.propose(list(ids[-STORE_N:]) + list(st.drafts),
                                            n - len(st.drafts))
            if not rest:
                return False
        st.drafts, st.from_lookup = st.drafts + rest, True
        st.lookup_copy = st.ngram_index.copied if conf is None else 0
        st.store_conf = conf
        if not seq.params.greedy:
            q = torch.zeros(len(rest), vocab_size, device=device)
            q[torch.arange(len(rest), device=device), torch.tensor(rest, device=device)] = 1.0
            st.draft_probs = q if st.draft_probs is None else torch.cat((st.draft_probs, q))
        return True

    def verified(self, seq, accepted: int, drafted: int) -> None:
        """After a verify of lookup drafts: grow or reset the sequence's next run length."""
        seq.spec.lookup_n = next_lookup_len(seq.spec.lookup_n or self.k, accepted == drafted,
                                            self.k, self.max_k)
