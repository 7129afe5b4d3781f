"""The cost controller's model of a step's seconds (engine/spec_control.py): the calibration
table by row count (engine/spec_calibrate.py), refined by the engine's own steps."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Protocol

# MeasuredCost's context regression: the EMA weight of a 1-row step, the steps before its slope
# is used, and the spread of keys (standard deviation) they must span
REG_ALPHA, REG_MIN, REG_SPREAD = 0.01, 32, 24.0
# The engine's MeasuredCost (`trust_after`): the steps a row count must have been seen at (after
# its warm-up) before its own EMA prices it; until then the table's value there, scaled by the
# measured level
TRUST_AFTER = 4


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
    _count: dict[int, int] = field(default_factory=dict, repr=False)  # row count -> steps seen
    trust_after: int = 1  # steps seen before a row count's EMA prices it (the engine's: 4)

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
        # NOTE: a row count seen fewer than `trust_after` times takes the table's shape at the
        # measured level instead of its own few steps: hybrid-demo's MTP controller priced a
        # 3-row verify 1.4 ms above a 2-row one (the table: ~0.2) from one slow step, and then
        # never verified 2 drafts again to learn better (2026-12-06)
        seen = {x: v for x, v in self.seen.items() if self._count.get(x, 0) >= self.trust_after}
        seen = seen or self.seen
        xs = sorted(seen)
        if self._target_xs is None:
            self._target_xs = sorted(self.target)
        ratio = {x: seen[x] / t if (t := _interp(self.target, x, self._target_xs)) > 0
                 else 1.0 for x in xs}
        pts = dict(seen)
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
        new = self.seen[rows] = seconds if old is None else old + self.alpha * (seconds - old)
        self._count[rows] = n = self._count.get(rows, 0) + 1
        others = [c for r, c in self._count.items() if r != rows]
        if old and others and n > max(others):
            # NOTE: the row count seen most (decode steps: 1 row at batch 1) carries the
            # machine's drift to the others, whose own steps may be rare: on a shared host a
            # 2-row verify learnt at 2.8 ms in a slow spell kept that price while 1-row steps
            # went back to 1.75 ms, and the 56% a draft then seemed to cost stopped hybrid-demo's
            # MTP drafting (accepted ~0.8) until probes re-taught it (2026-12-07). The others
            # keep their ratio to it; their own steps still move their EMA.
            f = new / old
            for r in self.seen:
                if r != rows:
                    self.seen[r] *= f
        # NOTE: a row count seen for the first time counts at once; EMA moves of known ones
        # every `refresh_every` steps (a step's refresh, the merge and the memo's ~20 costs
        # asked again, was ~20 us of a ~4 ms decode step; the EMAs move a few % a step)
        self._stale += 1
        if old is None or n == self.trust_after or self._stale >= self.refresh_every:
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
