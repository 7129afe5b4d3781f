"""Cost-aware speculation: how many drafts each sequence verifies next step, 0 included.

A fixed K pays for every draft whether or not it is accepted: on a CPU a verify step over 1 + K
rows and the drafter's K forwards can cost more than the tokens they win (bench/spec_phases.py:
a K=3 MTP step of hybrid-demo costs more than its accepted length buys at 2 threads). The
controller chooses, per step and per sequence, the number of drafts k that maximises the
expected tokens per second of the step,

    E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j   over   cost = target(rows) + drafter forwards,

from a cost model measured on this machine (`calibrate`: the deployed programs timed by row
count) and the sequence's recent conditional acceptance a_j per draft position (an EMA, started
from a global one). Drafter drafts are planned before drafting (`plan` sets `seq.spec.limit`,
so a skipped draft costs no forward; a sequence at 0 also defers the drafter's catch-up,
engine/drafting.py), n-gram lookup drafts, which cost no forward, are cut after matching
(`cut`). A sequence at 0 probes with one draft every `probe_every` steps so that acceptance
that comes back is seen; each probe that is rejected doubles that gap (up to `MAX_PROBE_GAP`),
each one accepted halves it.

Lookup acceptance is not a per-position rate: a lookup draft is right where the text goes on
copying an earlier passage, and whether it goes on depends on how long it has copied so far.
So a lookup draft's acceptance is `hold[bucket(m)]`, the chance that a copy which has held for
m tokens holds for one more, m = the match's copy length (`NgramIndex.copied`) + the draft's
position; one global table, started from LOOKUP_HOLD_PRIOR, learnt from every lookup verify.

Lossless: the controller only chooses how many drafts are proposed; the target verifies them as
ever (greedy or rejection sampling), and its decisions read host data only (no extra sync).
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.config import CONTROLLERS

__all__ = ["CONTROLLERS", "DRAFTER_MARGIN", "CostController", "CostModel", "MeasuredCost",
           "calibrate", "off_batches"]

# Copy lengths m (tokens a lookup match has copied) in buckets [.., 2), [2, 3), ..., [64, ..).
COPY_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# P(a copy of m tokens holds for one more) by bucket: the default model's greedy replies to 24
# held-out ShareGPT prompts (not the bench's first 6), n-gram lookup (4, 2), 1,540 lookup
# matches, Laplace-smoothed (bench/lookup_copy.py, bench/results/lookup_copy_avx2.json). Replayed
# with this machine's step costs by rows, drafts chosen by the controller over this table made
# 1.28x / 1.24x plain's tokens/s on the bench's 6 prompts / the other 24, fixed doubling runs
# 1.26x / 1.20x, knowing every draft's fate 1.47x / 1.38x (2026-12-03, AVX2, 2 threads).
LOOKUP_HOLD_PRIOR = (0.5, 0.58, 0.54, 0.77, 0.76, 0.93, 0.87, 0.95, 0.92, 0.98, 0.98, 0.96)
MAX_PROBE_GAP = 32
# MeasuredCost's context regression: the EMA weight of a 1-row step, the steps before its slope
# is used, and the spread of keys (standard deviation) they must span
REG_ALPHA, REG_MIN, REG_SPREAD = 0.01, 32, 24.0
# `wants_store`: the store is asked every step where a draft accepted with this probability
# pays a verify row (`break_even`), else only at probes after a cut to none
STORE_FREE_BELOW = 0.5
NEAR_EVEN = 0.9  # `_near_even`: a modelled rate within this share of plain's
# `off_batches`: speculation is off from a batch size where one draft for every sequence pays
# only at this acceptance or more (a compute-bound step). NOTE: on the default model at 16
# concurrent requests (2 cores, AVX-512, 2026-12-05) that acceptance is 0.64-0.84 in five
# calibrations, and suffix + controller, drafting in 5-8% of steps with 87% of its drafts
# accepted, ran at 0.95-0.98x plain in four bench runs: ~0.5 ms of a ~22 ms step is its host
# work (lookups, store, cut), and in a batch that finishes together the sequences a draft puts
# ahead wait for the slowest. At batch 1 it is 0-0.1, at 3 0-0.75 (noisy: see OFF_MIN_BATCH).
# On a 2-core Xeon with AMX (2026-12-05) it is 0.41-0.52 at 16 in four calibrations (AMX on or
# off), where 0.6 kept speculation on and `auto` ran at 0.915x plain in steady state (bench/
# spec_by_concurrency.py, 16 in flight) and 0.933x with 16 requests at once: lowered from 0.6.
OFF_BREAK_EVEN = 0.4
# ... judged at batch sizes of at least this. NOTE: below it a step reads the weights once for
# a few rows (a 6-row step cost ~1.2x a 3-row one here), but at batch 3 the calibrated ratio
# of 6 to 3 rows ranged 0-0.75 over nine calibrations: one slow timing of a ~4 ms step
OFF_MIN_BATCH = 8
REPLAN_EVERY = 8  # steps between plans of sequences settled at 0 drafter drafts (`plan`)
# The share by which a step with drafter drafts must beat plain decoding in the cost model
# before it is taken (the engine's controller; 0 in a bare CostController). The model errs by a
# few percent (cache effects of a drafter forward, EMA noise), and near break-even those errors
# all cost. Measured on the default model (2 cores, AVX-512, 6 held-out prompts x 4 rounds, the
# order rotating per prompt, 2026-12-04), margin 0 -> 0.05: replies ending at EOS (an ad-hoc
# run) EAGLE-3 + controller 0.982 -> 0.992x plain, MTP + controller 1.006 -> 1.030x; 128-token
# replies (bench/results/spec_controller_margin_avx512_1204.json) 1.024 -> 0.998x and 1.032 ->
# 1.044x. Within the noise either way; kept as a hedge against the model's errors.
DRAFTER_MARGIN = 0.05
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


class CostModel(Protocol):
    """Seconds of one target forward over `rows` rows (non-decreasing in rows: the
    controller's scans rely on it), and of one drafter forward."""

    def target_s(self, rows: int) -> float: ...

    def draft_s(self, rows: int) -> float: ...


def _interp(table: dict[int, float], x: int, xs: list[int] | None = None) -> float:
    """Piecewise linear in rows; below the table its first value, above it the last slope.
    `xs`: the table's keys sorted, where the caller keeps them (a cost is asked ~20 times a
    step, each sort and scan ~2 us)."""
    xs = sorted(table) if xs is None else xs
    if x <= xs[0]:
        return table[xs[0]]
    i = bisect.bisect_left(xs, x)
    if i < len(xs):
        a, b = xs[i - 1], xs[i]
        return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    if len(xs) == 1:
        return table[xs[0]] * x / xs[0]  # one point: proportional (an over-estimate of cost)
    a, b = xs[-2], xs[-1]
    return table[b] + max(table[b] - table[a], 0.0) * (x - b) / (b - a)


@dataclass
class MeasuredCost:
    """Seconds of a target forward by row count: the calibration table (`calibrate`, medians),
    refined by the engine's own steps (`observe`), interpolated.

    Why refine: `calibrate` times dummy requests with 16-token contexts at batch 1 and 3, but
    a real step's rows attend hundreds of keys, and a batch of 16 sits past the table, where its
    last slope is extrapolated. Each decode / verify step's measured seconds update an EMA at
    its row count (`alpha`). The model then interpolates over the measured row counts, and over
    the table's other row counts scaled by the nearest measured one's measured / table ratio (so
    a row count never seen keeps the table's shape at the measured level); the result is made
    non-decreasing in rows (one noisy point must not price an extra row below zero).

    Context: a step's attention reads every cached key of its sequences, so the same row count
    costs more at a longer context (the default model: ~3.4 ms a 1-row step at 16 keys, ~4.5
    at 300, ~6.5 at 1,200). Observed at mixed contexts, a row count's EMA learnt the context
    it happened to be seen at: on the default model the 2- and 3-row steps were seen early in
    a 256-token prompt and priced 0.7 / 2.4 ms above a 1-row step, against 0.35 / 0.8 ms at
    equal context, so the heads' drafts never paid (2026-12-05). So `ctx_coef` (seconds per
    cached key of the step's sequences) is learnt from the 1-row steps (a regression of their
    seconds on their keys, EMAs), every observation is stored net of `ctx_coef * keys`, and
    `target_s` adds `ctx_coef * context`, the keys of the step being planned (set by the
    controller, `CostController.set_context`)."""

    target: dict[int, float]
    draft: dict[int, float] = field(default_factory=dict)  # empty: no drafter (n-gram lookup)
    alpha: float = 0.1
    seen: dict[int, float] = field(default_factory=dict)  # row count -> EMA of measured seconds
    _merged: dict[int, float] | None = field(default=None, repr=False)
    _merged_xs: list[int] = field(default_factory=list, repr=False)
    _target_xs: list[int] | None = field(default=None, repr=False)
    _warm: set[int] = field(default_factory=set, repr=False)  # row counts past their warm-up
    _memo: dict[int, float] = field(default_factory=dict, repr=False)  # rows -> target_s
    _mono: dict[int, float] | None = field(default=None, repr=False)  # the table, monotone
    # observations between refreshes of the merged model (1: every one; the engine's: 8)
    refresh_every: int = 1
    _stale: int = field(default=0, repr=False)  # observations since the last refresh
    _draft_memo: dict[int, float] = field(default_factory=dict, repr=False)  # (a fixed table)
    ctx_coef: float = 0.0  # seconds per cached key of a step (learnt: `_regress`)
    context: float = 0.0  # cached keys of the step being planned
    _reg: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  # n, x, y, xx, xy

    def target_s(self, rows: int) -> float:
        return self._target_s(rows) + self.ctx_coef * self.context

    def _target_s(self, rows: int) -> float:
        v = self._memo.get(rows)  # NOTE: the controller asks the same row counts many times
        if v is None:
            if not self.seen:  # the table, made non-decreasing as `_merge` does
                v = self.table_s(rows)
            else:
                if self._merged is None:
                    self._merged = self._merge()
                    self._merged_xs = sorted(self._merged)
                v = _interp(self._merged, rows, self._merged_xs)
            self._memo[rows] = v
        return v

    def table_s(self, rows: int) -> float:
        """The calibration table alone (made non-decreasing), interpolated."""
        if self._mono is None:
            top, self._mono = 0.0, {}
            for r in sorted(self.target):
                top = self._mono[r] = max(top, self.target[r])
        return _interp(self._mono, rows)

    def _merge(self) -> dict[int, float]:
        xs = sorted(self.seen)
        if self._target_xs is None:
            self._target_xs = sorted(self.target)
        ratio = {x: self.seen[x] / t if (t := _interp(self.target, x, self._target_xs)) > 0
                 else 1.0 for x in xs}
        pts = dict(self.seen)
        for r, v in self.target.items():
            if r not in pts:
                near = min(xs, key=lambda x: (abs(x - r), -x))
                pts[r] = v * ratio[near]
        out, top = {}, 0.0
        for r in sorted(pts):
            top = max(top, pts[r])
            out[r] = top
        return out

    def _regress(self, keys: float, seconds: float) -> None:
        """A 1-row step's (keys, seconds) into EMAs of their moments (weight REG_ALPHA); the
        slope is `ctx_coef` once REG_MIN steps have been seen over a spread of keys of at least
        REG_SPREAD (else it stays: a batch-1 sequence's 128 steps span 128 keys), and never
        negative."""
        r, a = self._reg, REG_ALPHA
        r[0] += 1
        for i, v in enumerate((keys, seconds, keys * keys, keys * seconds), 1):
            r[i] += a * (v - r[i]) if r[0] > 1 else v - r[i]
        var = r[3] - r[1] * r[1]
        if r[0] >= REG_MIN and var >= REG_SPREAD ** 2:
            # never negative, nor a context share above the whole step's mean
            coef = min(max((r[4] - r[1] * r[2]) / var, 0.0), r[2] / max(r[1], 1.0))
            if abs(coef - self.ctx_coef) > 0.05 * max(self.ctx_coef, 1e-12):
                self.ctx_coef = coef

    def observe(self, rows: int, seconds: float, keys: float = 0.0) -> None:
        """One step of `rows` target rows over `keys` cached keys (its sequences' contexts)
        took `seconds` (forward and verification), stored net of the context's share. The first
        step at a row count is a warm-up (shape specialisation, scratch growth: several times
        a later one's) and is dropped, and a step is taken at most at twice (at least half)
        its row count's estimate: one slow outlier at a row count seldom run would otherwise
        price it out for good (the controller then never runs it, so never re-measures it)."""
        if not (rows > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if rows == 1 and keys > 0:
            self._regress(keys, seconds)
        seconds = max(seconds - self.ctx_coef * keys, 0.05 * seconds)
        if rows not in self._warm:
            self._warm.add(rows)
            return
        old = self.seen.get(rows)
        if old is not None:
            seconds = min(max(seconds, 0.5 * old), 2.0 * old)
        self.seen[rows] = seconds if old is None else old + self.alpha * (seconds - old)
        # NOTE: a row count seen for the first time counts at once; EMA moves of known ones
        # every `refresh_every` steps (a step's refresh, the merge and the memo's ~20 costs
        # asked again, was ~20 us of a ~4 ms decode step; the EMAs move a few % a step)
        self._stale += 1
        if old is None or self._stale >= self.refresh_every:
            self._stale = 0
            self._merged = None
            self._memo.clear()

    def draft_s(self, rows: int) -> float:
        """Seconds of a drafter forward over `rows` rows: the table made non-decreasing (a
        noisy point must not make a longer catch-up look cheaper), interpolated."""
        v = self._draft_memo.get(rows)
        if v is None:
            if not self.draft:
                v = 0.0
            else:
                mono, top = {}, 0.0
                for r in sorted(self.draft):
                    top = mono[r] = max(top, self.draft[r])
                v = _interp(mono, rows)
            self._draft_memo[rows] = v
        return v


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


def expected_tokens(acc: list[float], k: int) -> float:
    """Tokens a verify of k drafts yields (bonus included), acceptance `acc` conditional."""
    e, p = 1.0, 1.0
    for a in acc[:k]:
        p *= a
        e += p
    return e


class CostController:
    """`cost` a `CostModel`; `k` the drafter's chain length, `max_k` the longest verify (lookup
    runs); `drafter`: draft forwards cost (False for method="ngram"). `probe_every` 0: never
    probe (tests)."""

    # NOTE: alpha 0.1 (an EMA over ~10 verifies) and a probe every 4 idle steps: with 0.3 and
    # 16 an acceptance near the break-even point (the default model's heads: ~0.36 at the first
    # position) fell below it after one or two misses and was then seldom re-measured. On the
    # default model, 6 held-out prompts, 2 threads (2026-12-02): MTP + lookup 1.23x -> 1.37x
    # plain, EAGLE-3 1.03x -> 1.02x (noise), fixed lookup 1.32x.
    def __init__(self, cost: CostModel, k: int, max_k: int, drafter: bool = True,
                 probe_every: int = 4, alpha: float = 0.1, prior: float = 0.6,
                 alpha_lookup: float = 0.02, hold: tuple[float, ...] = LOOKUP_HOLD_PRIOR,
                 margin: float = 0.0):
        self.cost, self.k, self.max_k, self.drafter = cost, k, max_k, drafter
        self.margin = margin  # drafter drafts must beat plain by this share (`allocate`)
        self.probe_every, self.alpha, self.alpha_lookup = probe_every, alpha, alpha_lookup
        # global EMAs (slower), a new sequence's starting point
        self.glob = {"model": [prior] * max_k}
        if len(hold) != len(COPY_BUCKETS) + 1:
            raise ValueError(f"hold: needs {len(COPY_BUCKETS) + 1} values, got {len(hold)}")
        self.hold = list(hold)  # lookup: P(a copy holds one more token) by copy_bucket
        self.store_hold = list(STORE_PRIOR)  # suffix store: P(accepted) by store_bucket
        self.draft_scale = 1.0  # measured / modelled drafting time (`observe_draft`)
        self.overhead = 0.0  # seconds of a step outside the modelled parts (`observe_overhead`)
        self._behind: dict[int, int] = {}  # id(seq) -> deferred catch-up rows, as last planned
        self._quiet = 0  # plans skipped since the last allocate (`plan`)
        self._last_gap = 0  # the probe gap of the last drafter verify: a new sequence's start
        self.batch = 1  # sequences that wanted drafts at the last `cut` (`_lookup_gap`)
        self.store_free = True  # the store is asked every step (`wants_store`; set by `cut`)
        # batch sizes at which the engine runs no speculation (`off_batches`; set by the engine)
        self.off_batches: frozenset[int] = frozenset()

    def resized(self, k: int, max_k: int, drafter: bool) -> CostController:
        """This controller for an engine of chain length `k`, verifies up to `max_k` drafts."""
        self.k, self.drafter = k, drafter
        if max_k != self.max_k:
            self.max_k = max_k
            self.glob = {n: (g + g[-1:] * max_k)[:max_k] for n, g in self.glob.items()}
        return self

    def state(self, seq) -> SeqControl:
        c = seq.spec.control
        if c is None or len(c.model) != self.max_k:
            # NOTE: a new sequence starts from the others' experience: the global acceptance,
            # and the probe gap the last drafter verify left (from probe_every again, each
            # 128-token request of the default model's EAGLE-3 head, accepted ~0.3, probed ~8
            # times at ~0.8 ms lost apiece)
            c = seq.spec.control = SeqControl(list(self.glob["model"]), gap=self._last_gap)
        return c

    def lookup_acc(self, copied: int, n: int) -> list[float]:
        """Conditional acceptance of n lookup drafts of a match that copied `copied` tokens."""
        run = _BUCKET_RUNS.get(copied)
        if run is None or len(run) < n:  # (the buckets are fixed: one list per copy length)
            run = _BUCKET_RUNS[copied] = [copy_bucket(copied + j)
                                          for j in range(max(n, self.max_k))]
        h = self.hold
        return [h[b] for b in run[:n]]

    def wants_store(self, seq) -> bool:
        """Whether to ask the suffix store for this sequence's drafts this step: always where
        an even bet pays a verify row (`store_free`), else not while its last lookup / store
        drafts were cut to none and its next probe is not due (each skip counts as an idle
        step). Asking costs host time (~20 us a draft, per sequence: at 16 sequences ~1.4 ms of
        a ~24 ms step, 2026-12-04) that a cut would throw away."""
        c = self.state(seq)
        if c.idle_lookup and not self.store_free and c.idle_lookup + 1 < self._lookup_gap(c):
            c.idle_lookup += 1
            return False
        return True

    def break_even(self, batch: int) -> float:
        """The acceptance at which one more verify row pays at `batch` sequences: the tokens
        per second of B + p over B + 1 rows equal those of B over B rows. From the calibration
        table where the cost model has one (`MeasuredCost.table_s`: every row count timed at
        the same short context): the learnt model prices each row count at the contexts it was
        seen at, and at 16 concurrent requests its 17th row came out at 0-7x its cost between
        runs (no 1-row steps there to learn the context slope from, 2026-12-05)."""
        cost = getattr(self.cost, "table_s", self.cost.target_s)
        over = self.overhead
        t0, t1 = cost(batch) + over, cost(batch + 1) + over
        return batch * (t1 / t0 - 1.0) if t0 > 0 else math.inf

    def _lookup_gap(self, c: SeqControl) -> int:
        """Steps between a sequence's lookup / store probes: its gap times the batch's
        sequences. Lookup and store acceptance are global tables, taught by every sequence's
        verifies, so a batch of B probes each sequence B times more rarely for the same
        evidence a step. NOTE: at 16 concurrent requests a probe row every 4 steps per sequence
        (~1 a step: accepted ~0.78, near the break-even acceptance of a verify row there) and
        the store asks before it cost ~3% of plain decoding (2026-12-05)."""
        return (c.gap_lookup or self.probe_every) * self.batch

    def seq_lookup_acc(self, seq, n: int) -> list[float]:
        """Conditional acceptance of a sequence's first n drafts, its last ones from lookup or
        the suffix store (drafter drafts before them: its own estimate)."""
        conf = getattr(seq.spec, "store_conf", None)
        if conf is None:
            return self.lookup_acc(seq.spec.lookup_copy, n)
        m = len(seq.spec.drafts) - len(conf)  # drafter drafts first
        own = self.state(seq).model
        return ([own[min(j, len(own) - 1)] for j in range(min(m, n))]
                + [self.store_hold[store_bucket(c)] for c in conf[:max(n - m, 0)]])

    # ---- acceptance -----------------------------------------------------------------------------
    def observe(self, seq, accepted: int, drafted: int, from_lookup: bool) -> None:
        """After a verify: positions 1..accepted+1 were seen (accepted, then one rejected).
        NOTE: a segment of drafter drafts completed by lookup counts as lookup, its copy length
        from its first draft (an under-estimate of the drafter part's)."""
        c = self.state(seq)
        seen = min(accepted + 1, drafted, self.max_k)
        conf = getattr(seq.spec, "store_conf", None)
        if from_lookup and conf is not None:
            m = drafted - len(conf)  # the store's drafts follow the drafter's
            for j in range(max(m, 0), seen):
                b = store_bucket(conf[j - m])
                self.store_hold[b] += self.alpha_lookup * (float(j < accepted)
                                                           - self.store_hold[b])
            c.gap_lookup = self._gap(c.gap_lookup, accepted)
            return
        if from_lookup:
            copied, h, a = seq.spec.lookup_copy, self.hold, self.alpha_lookup
            for j in range(seen):
                b = copy_bucket(copied + j)
                h[b] += a * (float(j < accepted) - h[b])
            c.gap_lookup = self._gap(c.gap_lookup, accepted)
            return
        own, glob = c.model, self.glob["model"]
        c.settled = False
        a, ag = self.alpha, self.alpha / 3
        for j in range(seen):
            hit = float(j < accepted)
            own[j] += a * (hit - own[j])
            glob[j] += ag * (hit - glob[j])
        near = not accepted and self._near_even(own)
        c.gap = self._last_gap = self.probe_every if near else self._gap(c.gap, accepted)

    def _near_even(self, acc: list[float]) -> bool:
        """Whether one drafter draft at acceptance `acc` is modelled within NEAR_EVEN of plain
        decoding's rate. NOTE: a probe rejected there does not lengthen the gap: probing near
        break-even costs little, and estimates dip there by chance (an EMA of ~10 verifies at
        acceptance ~0.4: +-0.1). With doubling, the default model's heads (first-draft acceptance
        ~0.4, break-even ~0.35 on 2 cores) sat at 0 drafts, probing every 32 steps, for most of
        a request: EAGLE-3 + controller ~1.0x plain where a fixed K=1 made 1.11x (2026-12-05)."""
        return self.step_ratio([acc], [1]) >= NEAR_EVEN * self.step_ratio([acc], [0])

    def _gap(self, gap: int, accepted: int) -> int:
        """Steps between probes after a verify: halved (down to `probe_every`) when a draft was
        accepted, doubled (up to MAX_PROBE_GAP) when none was. A probe costs a verify row, and
        a drafter probe its catch-up forward too; drafts that keep failing are probed less
        often. NOTE: halving, not a reset: with the default model's heads (first-draft
        acceptance ~0.36, below break-even) a reset on every accepted probe kept probes ~6
        steps apart and cost EAGLE-3 + controller ~5% of plain decoding (2026-12-03); the
        walk now drifts to the longest gap where acceptance is under 1/2, and to the shortest
        where it is over (by then the estimate itself calls for drafts)."""
        if not gap:
            return self.probe_every
        return max(gap // 2, self.probe_every) if accepted else min(2 * gap, MAX_PROBE_GAP)

    def observe_step(self, rows: int, seconds: float, keys: float = 0.0) -> None:
        """A verify / decode step's measured time over `keys` cached keys, for cost models
        that learn (MeasuredCost)."""
        learn = getattr(self.cost, "observe", None)
        if learn is not None:
            if keys and hasattr(self.cost, "ctx_coef"):
                learn(rows, seconds, keys)
            else:
                learn(rows, seconds)

    def set_context(self, keys: float) -> None:
        """The cached keys of the sequences the next plan / cut decides for (their contexts):
        a context-aware cost model (MeasuredCost) prices their step at that context."""
        if hasattr(self.cost, "context"):
            self.cost.context = keys

    # ---- decisions ------------------------------------------------------------------------------
    def _cost(self, rows: int, chain: list[int], draft: bool, behind: int = 0) -> float:
        """A step of `rows` verified rows where `chain[s]` sequences draft more than s drafts:
        the target forward, and with `draft` the drafter's catch-up (about two rows per
        drafting sequence: its last token and an accepted draft, plus `behind` rows that the
        drafting sequences deferred while they drafted nothing) and its chain forwards (k - 1
        for k drafts: the catch-up drafts the first)."""
        t = self.cost.target_s(rows) + self.overhead
        if draft and self.drafter and chain[0]:
            t += self.draft_scale * self._draft_s(chain, behind)
        return t

    def _draft_s(self, chain: list[int], behind: int = 0) -> float:
        return self.cost.draft_s(2 * chain[0] + behind) + sum(
            self.cost.draft_s(c) for c in chain[1:] if c)

    def observe_draft(self, seqs: list, seconds: float) -> None:
        """The drafting phase of a step (`seqs` planned by `plan`) took `seconds`: what the
        drafter's forwards cost with the Python around them (metadata, the draft tokens'
        host copy, deferred rows), which the calibration's forward times leave out. An EMA
        of measured / modelled scales every drafter forward's modelled cost. True if the
        phase was modelled drafting (some drafter drafts were planned), taught or not."""
        ks = [s.spec.limit or 0 for s in seqs] if self.drafter else []
        if not any(ks) or not (seconds > 0 and math.isfinite(seconds)):
            return False
        # NOTE: a phase that caught up deferred rows (counted by `plan`; the catch-up has
        # consumed them by now) does not teach. Such a catch-up attends over the whole context
        # from cold caches, ~2x its calibrated time (16-token contexts) on the default model's
        # EAGLE-3, and these phases are mostly probes: teaching from them scaled every later
        # draft forward by 2-4x (2026-12-04/05), and the heads then never drafted where a
        # fixed K=1 made 1.14x (EAGLE-3) / 1.18x (MTP) plain's rate.
        if any(self._behind.get(id(s), 0) for s, k in zip(seqs, ks) if k):
            return True
        modelled = self._draft_s([sum(k > j for k in ks) for j in range(max(ks) + 1)])
        if modelled <= 0:
            return False
        ratio = min(max(seconds / modelled, 0.5), 8.0)
        self.draft_scale += self.alpha * (ratio - self.draft_scale)
        return True

    def observe_overhead(self, seconds: float) -> None:
        """A decode / verify step's time outside its forward, verification and drafter
        drafting (scheduling, metadata, appending, lookup matching, outputs): the same whatever
        is drafted, yet part of every step's cost (without it extra rows look dearer than
        they are: on the default model ~2 ms of a 10 ms step, 2 threads)."""
        if seconds >= 0 and math.isfinite(seconds):
            self.overhead += self.alpha * (seconds - self.overhead)

    def step_cost(self, ks: list[int], fixed_rows: int = 0, draft: bool = True) -> float:
        """The modelled seconds of a step verifying `ks` drafts per sequence (plus `fixed_rows`
        other rows)."""
        chain = [sum(k > s for k in ks) for s in range(max(ks, default=0) + 1)]
        return self._cost(fixed_rows + sum(1 + k for k in ks), chain, draft)

    def allocate(self, accs: list[list[float]], cap: list[int], fixed_rows: int = 0,
                 draft: bool = True, fixed_tokens: float = 0.0,
                 behind: list[int] | None = None) -> list[int]:
        """Drafts per sequence maximising expected tokens per second of the step (with
        `fixed_rows` other rows that yield `fixed_tokens`): greedy, each round the move that
        best improves the ratio: one sequence raised to any k up to its cap, or the m below k
        that gain most from it raised to k (a drafter forward is shared by the batch, so
        drafting may pay only for several at once). Exact at batch 1; drafts that cannot pay
        leave k at 0, and so do drafts whose step beats plain decoding by less than `margin`
        (of the modelled rate). `behind[i]`: drafter rows sequence i deferred, which its
        catch-up feeds first if it drafts. NOTE: host arithmetic, O(B K^2) a round;
        `allocate_rows` is the exact, fast form where drafts cost rows only."""
        ks = self._allocate(accs, cap, fixed_rows, draft, fixed_tokens, behind)
        if self.margin and draft and self.drafter and any(ks):
            plain = (fixed_tokens + len(accs)) / self._cost(fixed_rows + len(accs), [0], draft)
            if self.step_ratio(accs, ks, fixed_rows, fixed_tokens, behind) < plain * (
                    1 + self.margin):
                return [0] * len(accs)
        return ks

    def step_ratio(self, accs: list[list[float]], ks: list[int], fixed_rows: int = 0,
                   fixed_tokens: float = 0.0, behind: list[int] | None = None) -> float:
        """Modelled tokens per second of a step verifying `ks` drafter drafts."""
        chain = [sum(k > s for k in ks) for s in range(max(ks, default=0) + 1)]
        late = sum(b for b, k in zip(behind or [0] * len(ks), ks) if k)
        tokens = fixed_tokens + sum(expected_tokens(a, k) for a, k in zip(accs, ks))
        return tokens / self._cost(fixed_rows + sum(1 + k for k in ks), chain, True, late)

    def _allocate(self, accs, cap, fixed_rows, draft, fixed_tokens, behind) -> list[int]:
        n, top = len(accs), max(cap, default=0)
        late = behind or [0] * n
        late_rows = 0  # the deferred rows of the sequences drafting so far
        gain = [[expected_tokens(a, k) for k in range(c + 1)] for a, c in zip(accs, cap)]
        ks, chain = [0] * n, [0] * (top + 1)
        rows, tokens = fixed_rows + n, fixed_tokens + n
        best = tokens / self._cost(rows, chain, draft)
        if n == 1:  # every k at once: what the rounds below find, at a third of the host time
            for k in range(1, cap[0] + 1):
                chain[k - 1] = 1
                r = (tokens + gain[0][k] - 1.0) / self._cost(rows + k, chain, draft, late[0])
                if r > best * (1 + 1e-9):
                    best, ks[0] = r, k
            return ks
        while True:
            pick = None
            for i in range(n):  # one sequence up
                trial = list(chain)
                more = late_rows + (late[i] if not ks[i] else 0)
                for k in range(ks[i] + 1, cap[i] + 1):
                    trial[k - 1] += 1
                    r = (tokens + gain[i][k] - gain[i][ks[i]]) / self._cost(
                        rows + k - ks[i], trial, draft, more)
                    if r > best * (1 + 1e-9):
                        best, pick = r, [(i, k)]
            for k in range(1, top + 1) if n > 1 else ():  # the best m up to k
                up = sorted((i for i in range(n) if ks[i] < k <= cap[i]),
                            key=lambda i: gain[i][ks[i]] - gain[i][k])
                trial, r_rows, e, more = list(chain), rows, tokens, late_rows
                for m, i in enumerate(up):
                    for s in range(ks[i], k):
                        trial[s] += 1
                    more += late[i] if not ks[i] else 0
                    r_rows, e = r_rows + k - ks[i], e + gain[i][k] - gain[i][ks[i]]
                    r = e / self._cost(r_rows, trial, draft, more)
                    if m and r > best * (1 + 1e-9):
                        best, pick = r, [(j, k) for j in up[:m + 1]]
            if pick is None:
                return ks
            for i, k in pick:
                late_rows += late[i] if not ks[i] else 0
                for s in range(ks[i], k):
                    chain[s] += 1
                rows, tokens = rows + k - ks[i], tokens + gain[i][k] - gain[i][ks[i]]
                ks[i] = k

    def allocate_rows(self, accs: list[list[float]], cap: list[int], fixed_rows: int = 0,
                      fixed_tokens: float = 0.0) -> list[int]:
        """`allocate` where drafts cost verify rows only (lookup drafts): a sequence's j-th
        draft adds prod(acc[:j]) expected tokens, non-increasing in j, so the best m extra rows
        are the m largest such gains over the batch; the best m maximises (fixed_tokens +
        sequences + their sum) / cost(rows + m). Exact; O(B K log(B K)), one cost per m."""
        n = len(accs)
        gains = []
        for i, (a, c) in enumerate(zip(accs, cap)):
            p = 1.0
            for j in range(c):
                p *= a[j]
                gains.append((-p, j, i))  # ties: earlier positions first (a prefix each)
        gains.sort()
        rows, tokens = fixed_rows + n, fixed_tokens + n
        # NOTE: `_cost` without a drafter, inlined: it is asked once per candidate row, every
        # step (~16 a sequence with lookup runs of 16)
        target_s, over = self.cost.target_s, self.overhead
        best, best_m = tokens / (target_s(rows) + over), 0
        # no m whose cost reaches `top` / best can win: even every gain at once would not pay
        # it (costs never fall with rows), so the scan stops there (exact)
        top = tokens - sum(g[0] for g in gains)
        for m, (neg, _, _) in enumerate(gains, 1):
            tokens -= neg
            c = target_s(rows + m) + over
            r = tokens / c
            if r > best * (1 + 1e-9):
                best, best_m = r, m
            elif top <= best * c:
                break
        ks = [0] * n
        for _, _, i in gains[:best_m]:
            ks[i] += 1
        return ks

    def plan(self, seqs: list, fixed_rows: int = 0, fixed_tokens: float = 0.0) -> None:
        """Before drafting: `seq.spec.limit` (drafter drafts) for each sequence that decodes
        next step (beside `fixed_rows` rows of others, e.g. lookup runs, that yield
        `fixed_tokens`); a sequence at 0 probes with one draft every `probe_every` steps (more
        rarely after rejected probes)."""
        if not seqs:
            return
        if not self.drafter:  # n-gram lookup alone: nothing to plan (its drafts are `cut`)
            for s in seqs:
                s.spec.limit = 0
            return
        ctl = [self.state(s) for s in seqs]
        behind = [_behind_rows(s) for s in seqs]
        self._behind = {id(s): b for s, b in zip(seqs, behind) if b}
        if not fixed_rows and all(c.settled for c in ctl) and self._quiet < REPLAN_EVERY - 1:
            # NOTE: nothing that could make drafts pay has changed: no verify taught their
            # acceptance, the backlogs only grew; only the step costs drift (re-planned every
            # REPLAN_EVERY steps). The allocate it saves is ~40 us of a ~4 ms decode step
            self._quiet += 1
            ks = [0] * len(seqs)
        else:
            self._quiet = 0
            ks = self.allocate([c.model for c in ctl], [self.k] * len(seqs), fixed_rows,
                               fixed_tokens=fixed_tokens, behind=behind)
            for c, k in zip(ctl, ks):
                c.settled = not k
        for s, c, k in zip(seqs, ctl, ks):
            c.idle = 0 if k else c.idle + 1
            if not k and self.probe_every and c.idle >= (
                    c.gap or self.probe_every):
                k, c.idle = 1, 0
            s.spec.limit = k

    def cut(self, seqs: list) -> None:
        """After drafting: lookup drafts (no forward to pay) cut to what pays, jointly over the
        batch (`allocate_rows`), beside the rows and expected tokens of the others."""
        self.batch = max(len(seqs), 1)
        # NOTE: where a store draft right as often as not pays its row (batch 1 on the default
        # model: break-even ~0.15), whether the next tail's draft does is only known by asking:
        # skipping the asks after a cut to none cost suffix + controller ~5% at batch 1
        # (paired, 8 rounds, 2026-12-05). At 16 sequences (break-even ~1) they stay gated.
        self.store_free = self.break_even(self.batch) < STORE_FREE_BELOW
        look = [s for s in seqs if s.spec.from_lookup and s.spec.drafts]
        if not look:
            return
        rest = [s for s in seqs if not (s.spec.from_lookup and s.spec.drafts)]
        fixed_rows = sum(1 + len(s.spec.drafts) for s in rest)
        fixed_tokens = sum(expected_tokens(self.state(s).model, len(s.spec.drafts)) - 1
                           for s in rest if s.spec.drafts) + len(rest)
        caps = [len(s.spec.drafts) for s in look]
        ks = self.allocate_rows([self.seq_lookup_acc(s, n) for s, n in zip(look, caps)], caps,
                                fixed_rows, fixed_tokens)
        for s, n, k in zip(look, caps, ks):
            c = self.state(s)
            c.idle_lookup = 0 if k else c.idle_lookup + 1
            if not k and self.probe_every and c.idle_lookup >= self._lookup_gap(c):
                k, c.idle_lookup = 1, 0
            if k < n:
                cut_drafts(s.spec, k)


def off_batches(cost_s, calibrated: tuple[int, ...], top: int) -> frozenset[int]:
    """The batch sizes (up to `top`) at which speculation is off. At each calibrated batch size
    B >= OFF_MIN_BATCH, r(B) = cost(2B) / cost(B) - 1 is the acceptance one draft for every
    sequence (B more rows) needs to pay (`cost_s`: the calibration table, where B and 2B rows
    were both timed). Off from the smallest B where r(B) >= OFF_BREAK_EVEN, up; where r
    crosses the threshold between two calibrated sizes B1 < B2, from the first size at which r
    linearly interpolated between them does. NOTE: the ratio is interpolated, not the cost of a
    row count between them: across the kernels' 8-row tiles a step of 9 rows cost ~1.6x one of
    6 (2026-12-05), and with one row more the break-even swings with a single noisy timing (a
    17th row: 0-2.8 between calibrations). Why interpolate: on a 2-core Xeon with AMX r(8) was
    0.37-0.43 and r(16) 0.35-0.60 in six calibrations; a calibration with r(8) just under 0.4
    kept speculation on at 9-15, and a server at 16 in flight (15 and 16 running in turn) made
    0.956x plain's tokens/s, against 0.993x where r(8) had turned it off from 8
    (bench/spec_by_concurrency.py --lockstep, 2026-12-05); at 8 itself it paid (1.01-1.06x)."""
    prev = None
    for b in sorted(x for x in calibrated if x >= OFF_MIN_BATCH):
        t0 = cost_s(b)
        if t0 <= 0:
            continue
        r = cost_s(2 * b) / t0 - 1.0
        if r >= OFF_BREAK_EVEN:
            start = b
            if prev is not None and prev[1] < OFF_BREAK_EVEN:
                b1, r1 = prev
                for x in range(b1 + 1, b + 1):
                    if r1 + (r - r1) * (x - b1) / (b - b1) >= OFF_BREAK_EVEN:
                        start = x
                        break
            return frozenset(range(start, top + 1))
        prev = (b, r)
    return frozenset()


def _behind_rows(seq) -> int:
    """Drafter rows a sequence deferred while it drafted nothing (engine/drafting.py `defer_rows`):
    its next drafting step's catch-up feeds them first."""
    b = getattr(seq.spec, "behind", None)
    return len(b[1]) if b is not None else 0


def cut_drafts(st, n: int) -> None:
    """Keep a sequence's first `n` drafts (verifying fewer drafts is still exact)."""
    if getattr(st, "store_conf", None) is not None:  # the store's drafts come last
        st.store_conf = st.store_conf[:max(n - len(st.drafts) + len(st.store_conf), 0)]
    st.drafts = st.drafts[:n]
    if st.draft_probs is not None:
        st.draft_probs = st.draft_probs[:n] if n else None
    if not n:
        st.from_lookup = False


# ---- calibration ------------------------------------------------------------------------------
def calibrate(engine, batches: tuple[int, ...] = (1, 3), reps: int = 3,
              prompt_len: int = 16) -> MeasuredCost:
    """Times the deployed target and drafter forwards on this machine by row count: for each
    batch size, dummy greedy requests decode with 0..K (and the longest lookup run) fixed
    drafts (engine.fix_drafts), each for `reps` steps after a warm-up one (fewer steps and a
    shorter prompt where the context or the cache is short); medians per row count, the first
    forward at each row count left out. The engine is left as it was (its stats, draft source
    and prefix cache reset; the requests aborted). ValueError where not even one step each
    fits."""
    d = engine.deployed
    dev = getattr(engine, "device", None)
    sync = None
    if dev is not None and torch.device(dev).type == "cuda":
        sync = torch.cuda.synchronize
    samples: dict[str, dict[int, list[float]]] = {"target": defaultdict(list),
                                                  "draft": defaultdict(list)}
    saved, inputs = {}, {}

    def timed(name: str, attr: str):
        fn = getattr(d, attr)
        saved[attr] = fn

        def run(meta, *a, **kw):
            if a and isinstance(a[0], torch.Tensor):
                inputs[name] = a[0]  # (the drafter's hidden input: `_time_catch_ups`' shape)
            t = time.perf_counter()
            out = fn(meta, *a, **kw)
            if sync is not None:  # NOTE: a CUDA forward returns at launch; time its kernels
                sync()
            # NOTE: the first forward at a row count is a warm-up (shape specialisation)
            seen = samples[name].setdefault(-meta.num_tokens, [])
            dt = time.perf_counter() - t
            (samples[name][meta.num_tokens] if seen else seen).append(dt)
            return out
        setattr(d, attr, run)

    from specdeploy.engine.request import SamplingParams

    controller, source = engine.controller, engine.source
    engine.controller = None
    kmax = engine.max_k
    want = {"k": 0}
    engine.fix_drafts(lambda seq, n: [seq.all_ids[-1]] * min(want["k"], n))
    timed("target", "forward")
    if getattr(d, "draft_forward", None) is not None and d.draft is not None:
        timed("draft", "draft_forward")
    vocab = d.vocab_size
    try:
        for b in batches:
            if b > engine.scheduler.max_batch_size:
                break
            fit = _fit(engine, b, reps, prompt_len)
            if fit is None:
                break
            schedule, n_prompt, room = fit
            ids = [f"__calibrate_{b}_{i}" for i in range(b)]
            sp = SamplingParams(max_tokens=min(len(schedule) * (kmax + 1) + 2, room),
                                ignore_eos=True)
            for i, rid in enumerate(ids):
                prompt = [(7 + 13 * i + j) % vocab for j in range(n_prompt)]
                engine.add_request(prompt, sp, request_id=rid)
            engine.step()  # the prefill
            for k in schedule + schedule[-1:]:  # a step verifies the previous step's drafts
                want["k"] = k
                engine.step()
            if "draft" in inputs:
                _time_catch_ups(engine, ids, reps, inputs["draft"])
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
    finally:
        for attr, fn in saved.items():
            setattr(d, attr, fn)
        engine.source, engine.controller = source, controller
        engine.reset_spec_stats()
        engine.stats.__init__()  # in place: others may hold it
        engine.reset_prefix_cache()
    med = {name: {r: statistics.median(v) for r, v in t.items() if r > 0 and v}
           for name, t in samples.items()}
    if not med["target"]:
        raise ValueError(f"controller: too little room to calibrate the cost controller "
                         f"(max_seq_len={engine.max_seq_len}, {engine.blocks.num_pages} pages "
                         f"of {engine.blocks.page_size}, up to {kmax} drafts); give "
                         f"controller='off' (fixed K) or a longer max_seq_len")
    return MeasuredCost(med["target"], med["draft"], refresh_every=8)


# Rows a sequence's drafter catch-up feeds in calibration (`_time_catch_ups`), beside the 1..K+1
# of the drafting steps
CATCH_UP_ROWS = (8, 16, 32)


def _time_catch_ups(engine, ids: list[str], reps: int, like: torch.Tensor) -> None:
    """Times drafter forwards of n = CATCH_UP_ROWS rows a sequence (one logit each): the
    catch-up of a sequence that deferred its drafter rows for n steps while the controller gave
    it no drafts (engine/drafting.py `defer_rows`). Without them the drafter's table ended at K + 1
    rows a sequence and a catch-up of 17 deferred rows was priced as one of 4 (the last slope
    of a noisy table is often 0): ~0.46 against ~1.2 ms measured on the default model's
    EAGLE-3, which drove the measured / modelled drafting scale to ~4 and every draft out
    (2026-12-05). The rows overwrite the drafter cache of the calibration's own requests (at
    positions they already hold: no page is needed), which are aborted next. A drafter with
    recurrent state is left out (a catch-up there would move its state). `like`: a
    hidden input the drafter took (width, dtype, device)."""
    d = engine.deployed
    if any(getattr(getattr(p, "layout", None), "recurrent", False) for p in
           getattr(d, "drafts", ())):
        return
    seqs = [s for s in engine.scheduler.running if s.request_id in set(ids)]
    if not seqs:
        return
    for n in CATCH_UP_ROWS:
        if any(s.num_cached < n for s in seqs):
            break
        meta = build_metadata([Segment([0] * n, s.num_cached - n, s.pages, s.slot, 1)
                               for s in seqs])
        hidden = like.new_zeros(n * len(seqs), like.shape[-1])
        for _ in range(reps + 1):  # the first: the timed wrapper's warm-up
            d.draft_forward(meta, hidden)


def _fit(engine, b: int, reps: int, prompt_len: int):
    """(schedule of drafts per step, prompt length, tokens each request may make) for `b`
    calibration requests: `reps` steps per draft count and a `prompt_len` prompt, both cut
    down (to 1) until they fit the context and the cache; None if nothing fits."""
    kmax = engine.max_k
    per_seq = engine.blocks.num_pages * engine.blocks.page_size // b
    for r in range(reps, 0, -1):
        # NOTE: interleaved (0, 1, .., K, 0, 1, ..): in blocks, a row count's steps all ran
        # in whatever stretch the machine was in, and the ratio of 32 to 16 rows at batch 16
        # came out at 1.2-1.9 between calibrations (2026-12-05)
        schedule = [k for _ in range(r + 1) for k in sorted({*range(engine.k + 1), kmax})]
        n = min(prompt_len, engine.max_seq_len - kmax - 1 - len(schedule),
                per_seq - 2 * kmax - 2 - len(schedule))
        if n >= 1:
            return schedule, n, min(engine.max_seq_len - n - kmax - 1, per_seq - n - 2 * kmax - 2)
    return None
