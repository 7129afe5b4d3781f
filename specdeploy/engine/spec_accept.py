"""The cost controller's acceptance tables (engine/spec_control.py): a lookup draft's by the
length its match has copied, a suffix-store draft's by the store's own estimate, and a
sequence's controller state (conditional acceptance of its drafter drafts per position)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Copy lengths m (tokens a lookup match has copied) in buckets [.., 2), [2, 3), ..., [64, ..).
COPY_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# P(a copy of m tokens holds for one more) by bucket: the default model's greedy replies to 24
# held-out ShareGPT prompts (not the bench's first 6), n-gram lookup (4, 2), 1,540 lookup
# matches, Laplace-smoothed (bench/lookup_copy.py, bench/results/lookup_copy_avx2.json). Replayed
# with this machine's step costs by rows, drafts chosen by the controller over this table made
# 1.28x / 1.24x plain's tokens/s on the bench's 6 prompts / the other 24, fixed doubling runs
# 1.26x / 1.20x, knowing every draft's fate 1.47x / 1.38x (2026-12-03, AVX2, 2 threads).
LOOKUP_HOLD_PRIOR = (0.5, 0.58, 0.54, 0.77, 0.76, 0.93, 0.87, 0.95, 0.92, 0.98, 0.98, 0.96)

# Suffix-store drafts (engine/suffix_store.py) carry the store's own estimate c of each draft;
# P(accepted | c) by bucket of c, learnt from every store verify. The prior: the default model's
# greedy replies to 24 held-out prompts (not the bench's first 6) replayed over its store of
# 1.15M tokens, every store draft reached (bench/suffix_replay.py: 0.055, 0.152, 0.212, 0.231,
# 0.575, 0.526, 0.624, 0.673, 0.805), made non-decreasing; the shipped 2.42M-token store gives
# 0.039, 0.098, 0.21, 0.229, 0.547, 0.692, 0.623, 0.636, 0.898
# (bench/results/suffix_replay_shipped.json).
STORE_BUCKETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
STORE_PRIOR = (0.05, 0.15, 0.21, 0.25, 0.55, 0.56, 0.62, 0.67, 0.8)


def store_bucket(c: float) -> int:
    """The first bucket whose bound exceeds c (NaN: the last)."""
    return bisect.bisect_right(STORE_BUCKETS, c)


_BUCKET_RUNS: dict[int, list[int]] = {}  # copy length m -> copy_bucket(m + j) for j = 0, 1, ..


def copy_bucket(m: int) -> int:
    """The first bucket whose bound exceeds m (asked per draft, every step: bisect, ~0.2 us
    against a scan's ~1 us)."""
    return bisect.bisect_right(COPY_BUCKETS, m)


@dataclass
class SeqControl:
    """A sequence's controller state: conditional acceptance per draft position of its drafter
    drafts, steps since it last verified drafts of each kind, and the steps between probes."""

    model: list[float]
    idle: int = 0
    idle_lookup: int = 0
    gap: int = 0  # steps at 0 drafter drafts before a probe (0: not yet set)
    gap_lookup: int = 0
    settled: bool = False  # planned 0 drafter drafts, and no drafter verify since
    seen: list[int] = field(default_factory=list)  # verifies that reached each position


def expected_tokens(acc: list[float], k: int) -> float:
    """Tokens a verify of k drafts yields (bonus included), acceptance `acc` conditional."""
    e, p = 1.0, 1.0
    for a in acc[:k]:
        p *= a
        e += p
    return e
