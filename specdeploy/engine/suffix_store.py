"""Suffix drafts: continue the text the way the target's earlier replies went on.

vLLM's `method="suffix"` (after SuffixDecoding, Oliaro et al., 2024) drafts from the replies of
earlier requests; this is that idea over a plain token index. Where the sequence's own prompt
and reply have no earlier occurrence of its tail (n-gram lookup, engine/lookup.py, finds
nothing), the store finds the longest tail (up to MAX_N tokens) that occurred in its replies and
drafts the token that most often followed it, then the next one after that draft, while the
chain's estimated probability (the product of each draft's count / (occurrences + 1)) stays at
or above `min_prob`. What it drafts is verified like any draft, so output stays exact.

Two sources, both optional: a corpus loaded at deploy time (`SuffixStore.load`: the target's
own greedy replies to training prompts, `specdeploy suffix-store`; the default model ships one)
and the replies of this deployment's finished requests (`add`; the last `max_cached` kept).

The index: one flat int32 array of every reply's tokens (-1 between replies) and the positions
of the tokens that have two real tokens before them, sorted by the tokens before them. Below
2^16 - 1 ids (the default model's 49,152) the sort key is the four tokens before a position in
one uint64 (the last two, then the third and fourth from the end), so the candidates of a 2-,
3- and 4-token tail are each one contiguous range found by binary search; longer tails are
checked against the 4-token range's earlier tokens. Larger vocabularies key on the last two
tokens (exact below 2^31) and check every longer tail that way: a common pair (". The") has
thousands of candidates, filtered at ~0.3 ms a draft on the default model's store (2026-12-04).
"""
from __future__ import annotations

import collections
import json
from collections import deque
from pathlib import Path

import numpy as np

MAX_N = 6  # longest tail matched (tokens); the index itself keys on the last 2
FORMAT = "specdeploy-suffix-store"
REBUILD_EVERY = 8  # finished replies between rebuilds of the online index, past SMALL tokens
SMALL = 1 << 16  # an online index this small is rebuilt on every reply (~1 ms)
MEMO = 1 << 16  # tails remembered (next_token)


class TokenIndex:
    """Replies' tokens, positions sorted by the two tokens before them."""

    def __init__(self, docs: list, vocab_size: int):
        # NOTE: built in int32 / uint64 with in-place arithmetic: a 3.5M-token store's int64
        # temporaries peaked ~170 MiB above the index itself
        pad = np.full(MAX_N, -1, np.int32)
        parts = [pad]
        for d in docs:
            a = np.asarray(d)
            if a.size and (a.max() >= vocab_size or a.min() < -1):
                raise ValueError(f"suffix store: token ids outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
            parts += [a.astype(np.int32), pad[:1]]
        toks = np.concatenate(parts)
        # (the leading pad: every position has MAX_N tokens before it)
        ok = (toks[2:] >= 0) & (toks[1:-1] >= 0) & (toks[:-2] >= 0)
        ok[:MAX_N - 2] = False
        pos = (np.flatnonzero(ok) + 2).astype(np.int32)
        del ok
        self.vocab_size = vocab_size
        # wide: ids + 1 (the pad -1 -> 0) in 16 bits, and the last two's pair in 32
        self.wide = vocab_size < (1 << 16) - 1
        if self.wide:
            v1 = vocab_size + 1

            def before(n: int) -> np.ndarray:  # token n before each position, + 1, as uint64
                t = toks[pos - n].astype(np.uint64)
                t += np.uint64(1)
                return t

            key = before(2)
            key *= np.uint64(v1)
            key += before(1)
            key <<= np.uint64(32)
            t = before(3)
            t <<= np.uint64(16)
            key |= t
            del t
            key |= before(4)
            self.v1 = v1
        else:
            key = toks[pos - 2].astype(np.int64) * vocab_size + toks[pos - 1]
        order = np.argsort(key, kind="stable")  # stable: each key's positions stay ascending
        # NOTE: 8 bytes a key where the four tokens fit; else 4 where the pair does
        kdt = (np.uint64 if self.wide else np.uint32 if vocab_size * vocab_size < 1 << 32
               else np.int64)
        self.keys = key[order].astype(kdt, copy=False)
        del key
        self.pos = pos[order]
        self.toks = toks

    @property
    def num_tokens(self) -> int:
        return int((self.toks >= 0).sum())

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.pos.nbytes + self.toks.nbytes

    def candidates(self, tail: list[int]) -> list[np.ndarray]:
        """Positions whose preceding tokens equal the last n of `tail`, for n = 2.. as long as
        any match (index n - 2 of the list)."""
        if self.wide:
            return self._wide_candidates(tail)
        key = tail[-2] * self.vocab_size + tail[-1]
        lo, hi = np.searchsorted(self.keys, np.array((key, key + 1), self.keys.dtype))
        if hi <= lo:
            return []
        return self._narrow([self.pos[lo:hi]], tail)

    def _narrow(self, out: list[np.ndarray], tail: list[int]) -> list[np.ndarray]:
        """`out` (the candidates of the last 2 .. len(out) + 1 tokens) extended to longer
        tails by checking each candidate's earlier tokens, while any match."""
        for n in range(len(out) + 2, min(MAX_N, len(tail)) + 1):
            c = out[-1]
            c = c[self.toks[c - n] == tail[-n]]
            if not c.size:
                break
            out.append(c)
        return out

    def _wide_candidates(self, tail: list[int]) -> list[np.ndarray]:
        """`candidates` over the four-token key: n = 2, 3, 4 are nested ranges of the sort."""
        pair = ((tail[-2] + 1) * self.v1 + tail[-1] + 1) << 32
        bounds = [(pair, pair + (1 << 32))]
        if len(tail) >= 3:
            k3 = pair | ((tail[-3] + 1) << 16)
            bounds.append((k3, k3 + (1 << 16)))
            if len(tail) >= 4:
                k4 = k3 | (tail[-4] + 1)
                bounds.append((k4, k4 + 1))
        edges = np.searchsorted(self.keys, np.array([b for lh in bounds for b in lh], np.uint64))
        out = []
        for j in range(len(bounds)):
            lo, hi = int(edges[2 * j]), int(edges[2 * j + 1])
            if hi <= lo:
                return out
            out.append(self.pos[lo:hi])
        return self._narrow(out, tail)


class SuffixStore:
    """`static`: a loaded corpus (TokenIndex or None); `max_cached`: finished replies kept
    (0: none). `min_prob`: the chain's estimated probability below which drafting stops."""

    def __init__(self, vocab_size: int, static: TokenIndex | None = None, max_cached: int = 0,
                 min_prob: float = 0.1):
        self.vocab_size, self.static, self.max_cached = vocab_size, static, max_cached
        self.min_prob = min_prob
        self.recent: deque[list[int]] = deque(maxlen=max_cached or None)
        self.online: TokenIndex | None = None
        # tail -> next_token's answer: a step re-asks what the last step asked for the drafts
        # it accepted (NOTE: cleared when the online index changes, bounded by MEMO)
        self.memo: dict[tuple[int, ...], tuple[int, int, int] | None] = {}
        self.pending = 0  # replies added since the online index was built
        self.recent_tokens = 0

    @classmethod
    def load(cls, path, vocab_size: int, **kw) -> SuffixStore:
        """A corpus written by `save` (a directory with config.json and tokens.npz)."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"suffix_store: {str(path)!r} is not a suffix store directory "
                             "(no config.json; write one with `specdeploy suffix-store`)")
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("format") != FORMAT:
            raise ValueError(f"suffix_store: {str(path)!r} is not a {FORMAT} (format "
                             f"{cfg.get('format')!r})")
        if cfg.get("vocab_size") != vocab_size:
            raise ValueError(f"suffix_store: {str(path)!r} was built for a vocabulary of "
                             f"{cfg.get('vocab_size')} tokens, the target has {vocab_size}")
        with np.load(path / "tokens.npz") as z:
            flat, starts = z["tokens"], z["starts"]
        docs = np.split(flat, starts[1:]) if starts.size else []
        return cls(vocab_size, TokenIndex(docs, vocab_size), **kw)

    @staticmethod
    def save(path, docs: list[list[int]], vocab_size: int, meta: dict | None = None) -> dict:
        """Write `docs` (token id lists) as a corpus `load` reads; returns its config."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        lens = np.array([len(d) for d in docs], np.int64)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if docs else np.zeros(0, np.int64)
        flat = np.concatenate([np.asarray(d, np.int64) for d in docs]) if docs else np.zeros(0)
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            raise ValueError(f"suffix store: token ids outside the vocabulary "
                             f"(0..{vocab_size - 1})")
        dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        np.savez_compressed(path / "tokens.npz", tokens=flat.astype(dtype), starts=starts)
        cfg = {"format": FORMAT, "vocab_size": vocab_size, "num_replies": len(docs),
               "num_tokens": int(lens.sum()), **(meta or {})}
        (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        return cfg

    # ---- the online part ------------------------------------------------------------------------
    def add(self, ids: list[int]) -> None:
        """A finished request's reply joins the store (the oldest leaves past `max_cached`)."""
        if self.max_cached and len(ids) > 2:
            self.recent.append([int(t) for t in ids])
            self.recent_tokens = sum(map(len, self.recent))
            self.pending += 1
            if self.pending >= REBUILD_EVERY or self.recent_tokens <= SMALL:
                self._rebuild()

    def _rebuild(self) -> None:
        # NOTE: O(T log T) over the kept replies, every REBUILD_EVERY finished requests
        self.online = TokenIndex(list(self.recent), self.vocab_size) if self.recent else None
        self.pending = 0
        self.memo.clear()

    # ---- drafting -------------------------------------------------------------------------------
    def next_token(self, tail: list[int]) -> tuple[int, int, int] | None:
        """(the most frequent next token, its count, the occurrences) after the longest tail
        of `tail` (2..MAX_N tokens) found in the store, or None. Ties go to the smaller id."""
        if len(tail) < 2:
            return None
        key = tuple(tail[-MAX_N:])
        if key in self.memo:
            return self.memo[key]
        if len(self.memo) >= MEMO:
            self.memo.clear()
        out = self.memo[key] = self._next_token(key)
        return out

    def _next_token(self, tail: tuple[int, ...]) -> tuple[int, int, int] | None:
        per = [(ix, ix.candidates(tail)) for ix in (self.static, self.online) if ix is not None]
        n = max((len(c) for _, c in per), default=0)
        if not n:
            return None
        nxt = np.concatenate([ix.toks[c[n - 1]] for ix, c in per if len(c) >= n])
        if nxt.size <= 64:  # NOTE: most tails: a Python count beats np.unique's sort
            counts = collections.Counter(nxt.tolist())
            top = max(counts.values())
            return min(t for t, v in counts.items() if v == top), top, int(nxt.size)
        vals, counts = np.unique(nxt, return_counts=True)
        j = int(np.argmax(counts))
        return int(vals[j]), int(counts[j]), int(nxt.size)

    def propose(self, tail: list[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k drafts after `tail`, and each one's estimated conditional probability
        (count / (occurrences + 1): one sighting is a guess, fifty a habit)."""
        ctx = list(tail[-MAX_N:])
        drafts, conf, p = [], [], 1.0
        for _ in range(k):
            r = self.next_token(ctx)
            if r is None:
                break
            tok, count, total = r
            c = count / (total + 1)
            if p * c < self.min_prob:
                break
            p *= c
            drafts.append(tok)
            conf.append(c)
            ctx = (ctx + [tok])[-MAX_N:]
        return drafts, conf

    @property
    def num_tokens(self) -> int:
        return sum(ix.num_tokens for ix in (self.static, self.online) if ix is not None)
