"""Speculation on or off at large batch sizes, judged from the engine's own steps.

Why: at a large batch a step is compute-bound, and whether drafts pay is a few percent either
way. The calibration's off switch (`off_batches`) decides it from one ratio of two timed step
costs, which on a shared 2-core machine straddles its threshold from one calibration to the next
(2026-12-05: cost(16 rows) / cost(8) - 1 was 0.37-0.43 in six calibrations against a threshold
of 0.4), and the controller's cost model interpolates between the row counts it timed. Measured
side by side, a deployment that speculated at 8-15 running sequences made 0.956x plain's
tokens/s at 16 in flight, one whose calibration had turned it off there 0.993x
(bench/spec_by_concurrency.py --lockstep).

So at batch sizes of at least `min_batch` the engine runs trials: per bucket of batch sizes
(8, 9-16, 17-32, ...: a server at its limit of 16 runs 15 and 16 in turn, one bucket), after
`FIRST` decode steps there in the calibration's mode, it alternates `BLOCK` steps with
speculation on and `BLOCK` with it off (blocks interleaved, so the machine's drift falls on
both alike), `TRIAL` blocks each, then keeps the mode that made more tokens per second of step
(on only if by `MARGIN`) for `HOLD` steps, and tries again. A bucket the engine seldom visits
(a draining queue) keeps the calibration's mode: a trial there would mostly be spent in the
worse mode before it ends. Steps that prefill are not counted (their cost is the prompt's).
On this machine at 16 in flight a trial found plain 5% faster (704 against 671 tokens/s of
step; bench/spec_by_concurrency.py measured 0.956x for speculation there).

Lossless as the controller is: only whether drafts are proposed changes; they are verified as
ever.
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK = 8  # decode steps in one mode before a trial switches
TRIAL = 6  # blocks of each mode in a trial
FIRST = 256  # decode steps in a bucket, in the calibration's mode, before its first trial
HOLD = 1536  # decode steps the decided mode is kept before the next trial
MARGIN = 0.01  # speculation must beat plain by this share of tokens/s to stay on


def bucket_of(batch: int) -> int:
    """The bucket's largest batch size: the power of two at or above `batch`."""
    return 1 << (batch - 1).bit_length()


@dataclass
class _Bucket:
    on: bool  # the mode in force (in a trial: this block's)
    left: int  # steps left in the hold (or in this block, in a trial)
    trial: bool = False
    blocks: int = 0  # blocks finished in this trial
    tokens_on: int = 0
    seconds_on: float = 0.0
    tokens_off: int = 0
    seconds_off: float = 0.0

    def decide(self) -> None:
        rate_on = self.tokens_on / max(self.seconds_on, 1e-12)
        rate_off = self.tokens_off / max(self.seconds_off, 1e-12)
        self.on = rate_on > rate_off * (1.0 + MARGIN)
        self.trial, self.left = False, HOLD


class SpecJudge:
    """`on(batch)`: speculate in a step of `batch` running sequences? `record(batch, on,
    tokens, seconds)`: a finished decode step of that batch in that mode (its committed tokens,
    its wall time)."""

    def __init__(self, prior_off: frozenset[int], min_batch: int):
        self.prior_off, self.min_batch = prior_off, min_batch
        self._buckets: dict[int, _Bucket] = {}
        self.trials = 0  # trials decided (stats)

    def _bucket(self, batch: int) -> _Bucket:
        key = bucket_of(batch)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(on=batch not in self.prior_off, left=FIRST)
        return b

    def on(self, batch: int) -> bool:
        if batch < self.min_batch:
            return batch not in self.prior_off
        return self._bucket(batch).on

    def record(self, batch: int, on: bool, tokens: int, seconds: float) -> None:
        if batch < self.min_batch or seconds <= 0:
            return
        b = self._bucket(batch)
        if not b.trial:
            b.left -= 1
            if b.left <= 0:  # try again from the mode in force
                b.trial, b.left, b.blocks = True, BLOCK, 0
                b.tokens_on = b.tokens_off = 0
                b.seconds_on = b.seconds_off = 0.0
            return
        if on != b.on:  # a step decided before this block began
            return
        if on:
            b.tokens_on += tokens
            b.seconds_on += seconds
        else:
            b.tokens_off += tokens
            b.seconds_off += seconds
        b.left -= 1
        if b.left > 0:
            return
        b.blocks += 1
        if b.blocks >= 2 * TRIAL:
            b.decide()
            self.trials += 1
        else:
            b.on, b.left = not b.on, BLOCK

    def state(self) -> dict[int, str]:
        """Per bucket (its largest batch size): "on" / "off", "(trial)" while one runs."""
        return {k: ("on" if b.on else "off") + (" (trial)" if b.trial else "")
                for k, b in sorted(self._buckets.items())}
