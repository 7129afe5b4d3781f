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

import math

from specdeploy.config import CONTROLLERS
from specdeploy.engine.spec_accept import (
    _BUCKET_RUNS,
    COPY_BUCKETS,
    LOOKUP_HOLD_PRIOR,
    STORE_PRIOR,
    SeqControl,
    copy_bucket,
    expected_tokens,
    store_bucket,
)
from specdeploy.engine.spec_allocate import DraftAllocator
from specdeploy.engine.spec_calibrate import calibrate, off_batches
from specdeploy.engine.spec_cost import CostModel, MeasuredCost

# (the engine's imports: the controller, its cost model and calibration)
__all__ = ["CONTROLLERS", "DRAFTER_MARGIN", "CostController", "CostModel", "MeasuredCost",
           "calibrate", "off_batches"]

MAX_PROBE_GAP = 32
START_WEIGHT = 2  # a sequence's starting acceptance weighs as this many verifies (`observe`)
# `wants_store`: the store is asked every step where a draft accepted with this probability
# pays a verify row (`break_even`), else only at probes after a cut to none
STORE_FREE_BELOW = 0.5
NEAR_EVEN = 0.9  # `_near_even`: a modelled rate within this share of plain's
REPLAN_EVERY = 8  # steps between plans of sequences settled at 0 drafter drafts (`plan`)
# The share by which a step with drafter drafts must beat plain decoding in the cost model
# before it is taken (the engine's controller; 0 in a bare CostController). The model errs by a
# few percent (cache effects of a drafter forward, EMA noise), and near break-even those errors
# all cost. Measured on the default model (2 cores, AVX-512, 6 held-out prompts x 4 rounds, the
# order rotating per prompt, 2026-12-04), margin 0 -> 0.05: replies ending at EOS (an ad-hoc
# run) EAGLE-3 + controller 0.982 -> 0.992x plain, MTP + controller 1.006 -> 1.030x; 128-token
# replies (bench/results/spec_controller_margin_avx512_1204.json) 1.024 -> 0.998x and 1.032 ->
# 1.044x. Within the noise either way; kept as a hedge against the model's errors.
# 0 since stop 65, once the model stopped learning from graph captures and priced a verify
# step's host work apart: paired in one process (bench/spec_margin.py, 2 cores AVX2,
# 2026-12-07), margin 0 against 0.05 won 14 of 17 runs: medians over plain hybrid-demo's MTP
# 1.012x vs 0.973x (7 runs), the default model's EAGLE-3 1.020x vs 0.990x and MTP head 1.062x
# vs 1.024x (5 runs each); the hedge now cost the drafts that paid.
DRAFTER_MARGIN = 0.0


class CostController(DraftAllocator):
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
        self._glob_seen = [0] * max_k  # verifies that reached each drafter position
        if len(hold) != len(COPY_BUCKETS) + 1:
            raise ValueError(f"hold: needs {len(COPY_BUCKETS) + 1} values, got {len(hold)}")
        self.hold = list(hold)  # lookup: P(a copy holds one more token) by copy_bucket
        self.store_hold = list(STORE_PRIOR)  # suffix store: P(accepted) by store_bucket
        # measured / modelled drafting time by chain length (index: the step's longest chain,
        # `observe_draft`); 1.0 until a phase of that length teaches it
        self.draft_scales = [1.0] * (max_k + 1)
        # seconds of a step outside the modelled parts, steps verifying no draft / some
        # (`observe_overhead`, `host_s`; None: no verify step seen yet)
        self.overhead, self.overhead_verify = 0.0, None
        self.fixed_verify = False  # (`plan` / `cut`: others' drafts make it a verify step)
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
            self._glob_seen = (self._glob_seen + [0] * max_k)[:max_k]
            self.draft_scales = (self.draft_scales + [1.0] * (max_k + 1))[:max_k + 1]
        return self

    def state(self, seq) -> SeqControl:
        c = seq.spec.control
        if c is None or len(c.model) != self.max_k:
            # NOTE: a new sequence starts from the others' experience: the global acceptance,
            # and the probe gap the last drafter verify left (from probe_every again, each
            # 128-token request of the default model's EAGLE-3 head, accepted ~0.3, probed ~8
            # times at ~0.8 ms lost apiece)
            # ... unless one draft at the global estimate is modelled near even with plain
            # decoding: then the first probe comes soon (hybrid-demo after a looping reply: the
            # next request probed after 32 steps of its 88, accepting ~0.95, 2026-12-06)
            glob = list(self.glob["model"])
            gap = self._last_gap
            if gap > self.probe_every and self.drafter and self._near_even(glob):
                gap = self.probe_every
            # and its first plan at 0 drafts probes (`idle` one short of the gap): acceptance
            # differs more between requests than within one (hybrid-demo: ~0.4 on a looping
            # reply, ~0.95 on the next), and one probe a request is cheap evidence
            c = seq.spec.control = SeqControl(glob, gap=gap,
                                              idle=max((gap or self.probe_every) - 1, 0))
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
        t0, t1 = cost(batch) + self.host_s(False), cost(batch + 1) + self.host_s(True)
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
        ag = self.alpha / 3
        if len(c.seen) < len(own):
            c.seen += [0] * (len(own) - len(c.seen))
        for j in range(seen):
            hit = float(j < accepted)
            # NOTE: a sequence's first verifies weigh as evidence beside its starting estimate
            # (worth START_WEIGHT of them), then the EMA's alpha: a new sequence starts from
            # the global estimate, which the requests before it set. hybrid-demo after a
            # prompt whose replies looped (acceptance ~0.4): the next one, accepting ~0.95,
            # took ~50 of its 88 steps to climb past break-even at alpha 0.1 (2026-12-06).
            c.seen[j] += 1
            a = max(self.alpha, 1.0 / (START_WEIGHT + c.seen[j]))
            own[j] += a * (hit - own[j])
            glob[j] += ag * (hit - glob[j])
            self._glob_seen[j] += 1
        # NOTE: a position no verify has reached yet follows the one before it, not the prior:
        # drafts past the first are planned only where their modelled acceptance pays, so a
        # prior below that was never tested. hybrid-demo's MTP head (first-draft acceptance
        # ~0.7-0.9, the next ones ~0.7) sat at one draft with the next positions at the prior
        # 0.6: its controller ran 1.12x plain where a fixed K=3 ran 1.22x (2026-12-06,
        # bench/spec_isolated.py).
        for j in range(max(seen, 1), len(own)):
            if j >= len(self._glob_seen) or self._glob_seen[j]:
                break
            own[j], glob[j] = own[j - 1], glob[j - 1]
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
        # NOTE: one scale per chain length: the phase's Python (metadata, the drafts' copies)
        # is partly per phase, so it weighs less per forward in longer chains. hybrid-demo's
        # MTP head, measured / modelled: 1.62 at 1 draft, 1.43 at 2, 1.35 at 3 (2026-12-06);
        # one scale learnt at 1 draft priced the longer chains ~20% high
        n = min(max(ks), len(self.draft_scales) - 1)
        self.draft_scales[n] += self.alpha * (ratio - self.draft_scales[n])
        return True

    @property
    def draft_scale(self) -> float:
        """The drafting scale of the longest chain (K drafts)."""
        return self.draft_scales[-1]

    def observe_overhead(self, seconds: float, verify: bool = False) -> None:
        """A decode / verify step's time outside its forward, verification and drafter
        drafting (scheduling, metadata, committing, appending, lookup matching, outputs): part
        of every step's cost (without it extra rows look dearer than they are: on the default
        model ~2 ms of a 10 ms step, 2 threads), learnt apart for steps that verified drafts
        (`verify`: `host_s`)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        if not verify:
            self.overhead += self.alpha * (seconds - self.overhead)
        elif self.overhead_verify is None:  # the first: a start that needs no warm-up
            self.overhead_verify = seconds
        else:
            self.overhead_verify += self.alpha * (seconds - self.overhead_verify)

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
            self.fixed_verify = fixed_rows > 0  # (the lookup runs of others: verify rows)
            try:
                ks = self.allocate([c.model for c in ctl], [self.k] * len(seqs), fixed_rows,
                                   fixed_tokens=fixed_tokens, behind=behind)
            finally:
                self.fixed_verify = False
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
        self.fixed_verify = any(s.spec.drafts for s in rest)  # (drafter drafts of others)
        try:
            ks = self.allocate_rows([self.seq_lookup_acc(s, n) for s, n in zip(look, caps)],
                                    caps, fixed_rows, fixed_tokens)
        finally:
            self.fixed_verify = False
        for s, n, k in zip(look, caps, ks):
            c = self.state(s)
            c.idle_lookup = 0 if k else c.idle_lookup + 1
            if not k and self.probe_every and c.idle_lookup >= self._lookup_gap(c):
                k, c.idle_lookup = 1, 0
            if k < n:
                cut_drafts(s.spec, k)


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
