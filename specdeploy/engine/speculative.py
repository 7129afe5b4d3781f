"""One-model speculative decoding on `Engine`'s step hooks (DESIGN.md invariant 4).

A step, as `Engine.step` reads it:
1. propose (`_segments`): a sequence with drafts feeds one EXTEND segment [last token, d_1..d_K]
   at positions n-1..n-1+K; the step's drafts form one `Drafts` record.
2. forward: prefill chunks as usual, extend segments beside them.
3. verify (`_verify`): `engine/verify.py` over the whole batch (greedy or rejection sampling);
   one host synchronisation copies every sequence's accepted count and next token.
4. commit (`_commit`): KV by length bookkeeping (`num_cached += 1 + accepted`); recurrent state
   by promoting the spec-state entry `accepted` (after the last kept token) into the slot. With
   prefix caching, a checkpointed page boundary inside the kept tokens copies that token's spec
   state into the checkpoint pool: only committed tokens, so a rejected draft never gets cached.
   The drafter's KV shares the target's pages and so is cached alongside it (see `__init__`).
5. append: token by token with stop checks (a stop inside an accepted run cuts it there).
6. draft (`_after_step`): the draft source proposes the next step's drafts (engine/drafting.py).
"""
from __future__ import annotations

import time

import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment
from specdeploy.deploy.base import StepOutput
from specdeploy.engine.drafting import (
    DraftSource,
    DraftWork,
    FixedDrafter,
    LookupDrafter,
    ModelDrafter,
    cut_to_grammar,
    defer_rows,
)
from specdeploy.engine.engine import Engine
from specdeploy.engine.lookup import Lookup
from specdeploy.engine.request import Sequence
from specdeploy.engine.scheduler import ScheduledSeq, SpecScheduler
from specdeploy.engine.spec_control import (
    CONTROLLERS,
    DRAFTER_MARGIN,
    CostController,
    MeasuredCost,
    calibrate,
    off_batches,
)
from specdeploy.engine.spec_stats import SpecStats
from specdeploy.engine.suffix_store import SuffixStore
from specdeploy.engine.verify import member_rows
from specdeploy.engine.verify_rows import verify_rows


class SpecEngine(Engine):
    """`deployed` is a `SpecDeployed`. `set_lookup((max n, min n), tokens)` turns on n-gram
    lookup drafts (engine/lookup.py) ahead of the drafter's; a match drafts `tokens` (default
    K). `fix_drafts(fn)` makes `fn(seq, max drafts)` propose instead (tests, benches), every
    draft verified. `set_controller` turns the cost controller on or off (engine/spec_control.py;
    `SpecConfig.controller`)."""

    def __init__(self, deployed, tokenizer=None, **kw):
        super().__init__(deployed, tokenizer, **kw)
        spec = deployed.spec
        self.k = deployed.num_draft_tokens
        self._draft_min_prob: float = spec.draft_min_prob
        # speculation off in steps with more than this many running sequences (None: the
        # controller's `off_batches`)
        self.disable_by_batch_size: int | None = spec.disable_by_batch_size
        self.scheduler = SpecScheduler(self.blocks, self.scheduler.max_batch_size,
                                       self.scheduler.max_num_tokens,
                                       recurrent=self.scheduler.chunk_align > 1)
        self.spec_stats = SpecStats(self.k)  # reset in place: the draft sources hold it
        # NOTE: the drafter's KV lives in the target's pages, so a prefix hit serves it too (no
        # recompute: that would need the target's hidden states of the whole hit span). Its row
        # at position p reads token p+1, so a finishing sequence's last pages, whose rows the
        # drafter has not caught up on, are not cached.
        self._cache_on_finish = deployed.draft is None
        self.controller: CostController | None = None
        self._step_parts: list[float] | None = None  # this step's timed parts (`_timed`)
        self._seen_captures = 0  # graphs captured as of the last check (`_fresh_captures`)
        self._measured: MeasuredCost | None = None  # calibrated once, on first use
        self._calibrated: tuple[int, ...] = ()  # the batch sizes `calibrate` timed
        # the suffix store (engine/suffix_store.py): drafts behind lookup's, from the corpus
        # loaded at deploy time and this engine's finished replies
        self.store = SuffixStore(
            deployed.vocab_size, getattr(deployed, "suffix_corpus", None),
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_min_token_prob,
        ) if spec.uses_store else None
        max_n = spec.prompt_lookup_max
        self.set_lookup((max_n, spec.prompt_lookup_min) if max_n else None,
                        spec.prompt_lookup_num_tokens)
        self.set_controller(spec.controller)

    # ---- configuration ------------------------------------------------------------------------
    def set_lookup(self, lookup: tuple[int, int] | None, num_tokens: int | None = None) -> None:
        """N-gram lookup (max n, min n), None: off; a match drafts up to `num_tokens` (None:
        K), growing from K while lookup runs are accepted whole (`next_lookup_len`). Resets
        the acceptance counters (their per-position list is sized by the longest segment). A
        target with recurrent state holds spec states for the deployed max(K,
        prompt_lookup_num_tokens) drafts only."""
        self.lookup_k = (num_tokens or self.k) if lookup else 0
        self.max_k = max(self.k, self.lookup_k)  # the most drafts in one verify segment
        self.lookup = Lookup(*lookup, self.k, self.lookup_k,
                             getattr(self, "store", None)) if lookup else None
        self.scheduler.lookahead = self.max_k
        self.reset_spec_stats()
        self.own_source = self._own_source()
        self.source: DraftSource = self.own_source
        if getattr(self, "controller", None) is not None:  # sized by the longest verify
            self.set_controller(self.controller)

    def set_controller(self, controller: str | CostController | None) -> None:
        """"cost": the cost controller over this machine's measured costs (calibrated on first
        use, ~1 s on the default model); a `CostController` (e.g. over a synthetic cost
        model; it is resized to this engine's K); "off" / None: every draft is verified."""
        if controller in (None, "off"):
            self.controller = None
            if self.lookup is not None:
                self.lookup.longest, self.lookup.controller = False, None
            return
        if controller == "cost":
            if self._measured is None:
                # NOTE: also at the batch the engine will run (up to 16): rows past 3
                # sequences were extrapolated, and at 16 concurrent requests the controller
                # over-drafted until its own steps had taught it (2026-12-04, docs/benchmarks.md)
                top = min(self.scheduler.max_batch_size, 16)
                # NOTE: 8 as well below a top of 16: speculation is off from the smallest
                # calibrated size that judges it dear, so a batch of 8-15 (a draining queue)
                # does not speculate where 16 would not (2 cores with AMX, 2026-12-05)
                self._calibrated = (1, 3) + ((8,) if top > 8 else ()) + (
                    (top,) if top >= 8 else ())
                self._measured = calibrate(self, batches=self._calibrated)
            controller = CostController(self._measured, self.k, self.max_k,
                                        margin=DRAFTER_MARGIN)
            controller.off_batches = off_batches(self._measured.table_s, self._calibrated,
                                                 self.scheduler.max_batch_size)
        elif not isinstance(controller, CostController):
            raise ValueError(f"controller: must be one of {', '.join(CONTROLLERS)} or a "
                             f"CostController, got {controller!r}")
        self.controller = controller.resized(self.k, self.max_k, self.deployed.draft is not None)
        if self.lookup is not None:  # every match drafts the longest run; the controller cuts
            self.lookup.longest, self.lookup.controller = True, self.controller

    def _own_source(self) -> DraftSource:
        d = self.deployed
        if d.draft is None:  # method="ngram"
            return LookupDrafter(self.lookup, d.vocab_size, self.device, self.spec_stats)
        return ModelDrafter(d, self.k, self.lookup, self._draft_min_prob, self.spec_stats,
                            self.generator)

    @property
    def draft_min_prob(self) -> float:
        """The drafter's confidence stop (engine/drafting.py `ModelDrafter`); 0: off."""
        return self._draft_min_prob

    @draft_min_prob.setter
    def draft_min_prob(self, p: float) -> None:
        self._draft_min_prob = p
        if isinstance(self.own_source, ModelDrafter):
            self.own_source.min_prob = p

    def fix_drafts(self, fn=None) -> None:
        """`fn(seq, max drafts) -> list[int]` proposes every draft from now on (the deployment's
        own source still runs first, so a drafter's KV stays current); None: back to it."""
        inner = self.own_source if self.deployed.draft is not None else None
        self.source = self.own_source if fn is None else FixedDrafter(
            fn, self.max_k, self.deployed.vocab_size, self.device, self.spec_stats, inner)

    def _finish(self, seq: Sequence, reason: str) -> None:
        super()._finish(seq, reason)
        if self.store is not None and reason in ("stop", "length"):
            self.store.add(seq.output_ids)  # a later request may draft from this reply

    def reset_spec_stats(self) -> None:
        self.spec_stats.reset(self.max_k)

    def stats_dict(self) -> dict:
        n = self.disable_by_batch_size
        off = (list(range(n + 1, self.scheduler.max_batch_size + 1)) if n is not None
               else sorted(self.controller.off_batches) if self.controller is not None else [])
        return {**super().stats_dict(), **self.spec_stats.as_dict(), "spec_off_batch_sizes": off}

    def _captures(self) -> int:
        """Graphs captured so far by the target's and the drafter's runners."""
        d = self.deployed
        runners = [getattr(getattr(d, "target", d), "graph_runner", None)]
        runners += [getattr(p, "graph_runner", None) for p in getattr(d, "drafts", ())]
        return sum(r.captures for r in runners if r is not None)

    def _fresh_captures(self) -> bool:
        """Whether a graph was captured since the last call: that step's times are a capture's
        (~10-50 ms on the CPU), not its cost. NOTE: on hybrid-demo the drafter's catch-up
        pieces (1..K+1 rows, powers of two) captured through the first requests, and their
        times, clamped at 8x, left the drafting scale at ~2.3x its cost: the controller then
        drafted in 20-40% of steps where one draft in every step made 1.05x plain (2026-12-07)."""
        n = self._captures()
        fresh, self._seen_captures = n != self._seen_captures, n
        return fresh

    def _timed(self, segs: list[Segment], rows: int, seconds: float) -> None:
        # NOTE: decode and verify steps only; a prefill chunk's rows cost another amount each
        ctl = self.controller
        if self._fresh_captures():
            self._step_parts = None
            return
        if ctl is not None and all(s.kind == SEG_EXTEND or len(s.token_ids) == 1 for s in segs):
            ctl.observe_step(rows, seconds, sum(s.cache_len for s in segs))
            # the forward + verification, the drafting, whether drafts were verified
            self._step_parts = [seconds, 0.0, any(s.kind == SEG_EXTEND for s in segs)]

    def _stepped(self, seconds: float) -> None:
        parts, self._step_parts = self._step_parts, None
        if parts is not None and self.controller is not None:
            self.controller.observe_overhead(seconds - parts[0] - parts[1], parts[2])

    # ---- the step hooks -----------------------------------------------------------------------
    def _segments(self, batch: list[ScheduledSeq]) -> list[Segment]:
        segs = super()._segments(batch)
        for i, s in enumerate(batch):
            st = s.seq.spec
            if st.drafts:
                ids = s.seq.pending_ids(1) + st.drafts
                segs[i] = Segment(ids, s.seq.num_cached, s.seq.pages, s.seq.slot, len(ids),
                                  SEG_EXTEND, mm=s.seq.mm, win_pages=s.seq.win_pages)
        return segs

    def _verify(self, batch: list[ScheduledSeq], segs: list[Segment], out: StepOutput
                ) -> list[list[int]]:
        """Accepted drafts + the next token of every sequence that samples; [] for
        mid-prefill chunks. A step without drafts takes the plain engine's path (~35 us less
        host work a step at 16 sequences: where speculation is off, every step)."""
        if not any(seg.kind == SEG_EXTEND for seg in segs):
            return super()._verify(batch, segs, out)
        rows, live, k1 = member_rows(tuple(seg.num_logits for seg in segs),
                                     tuple(seg.kind == SEG_EXTEND or s.samples
                                           for s, seg in zip(batch, segs)))
        if not live:
            return [[] for _ in batch]
        seqs = [batch[i].seq for i in live]
        try:
            num, nxt = self._verify_rows(out.logits, rows, k1, seqs)
        except Exception:  # one sequence's verification failed: it alone fails
            num, nxt = [], []
            for r, seq in enumerate(seqs):
                try:
                    (a,), (t,) = self._verify_rows(out.logits, rows[r:r + 1], k1, [seq])
                except Exception as e:
                    self.fail(seq, e)
                    a, t = 0, None
                num.append(a)
                nxt.append(t)
        tokens: list[list[int]] = [[] for _ in batch]
        st = self.spec_stats
        for i, seq, a, t in zip(live, seqs, num, nxt):
            if seq.finished:
                continue
            drafted = seq.spec.drafts
            tokens[i] = drafted[:a] + [t]
            if segs[i].kind != SEG_EXTEND:
                continue
            st.draft_steps += 1
            st.draft_tokens += len(drafted)
            st.accepted_tokens += a
            for j in range(a):
                st.accepted_per_position[j] += 1
            if self.controller is not None:
                self.controller.observe(seq, a, len(drafted), seq.spec.from_lookup)
            if seq.spec.from_lookup:
                st.lookup_steps += 1
                st.lookup_accepted_tokens += a
                if seq.spec.store_conf is not None:
                    st.store_steps += 1
                    st.store_accepted_tokens += a
                self.lookup.verified(seq, a, len(drafted))
        return tokens

    def _verify_rows(self, logits: torch.Tensor, rows: tuple[tuple[int, ...], ...], k1: int,
                     seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        return verify_rows(logits, rows, k1, seqs, self.deployed.vocab_size,
                           self.eos_token_ids, self.generator)

    def _commit(self, batch: list[ScheduledSeq], segs: list[Segment],
                tokens: list[list[int]]) -> list[int]:
        """KV by length; recurrent states of extend segments promoted to the last kept token."""
        if not any(seg.kind == SEG_EXTEND for seg in segs):  # no drafts: the plain commit
            for s in batch:
                s.seq.spec.clear()
            return super()._commit(batch, segs, tokens)
        cached, slots, idx = [], [], []
        for s, seg, new in zip(batch, segs, tokens):
            if s.seq.finished:  # failed in `_verify`: its slot is free, nothing to promote
                cached.append(0)
            elif seg.kind == SEG_EXTEND:  # the last token + the accepted drafts are now cached
                cached.append(len(new))
                slots.append(s.seq.slot)
                idx.append(len(new) - 1)
            else:
                cached.append(s.num_tokens)
            s.seq.num_cached += cached[-1]
            s.seq.spec.clear()
        if slots and getattr(self.deployed, "has_spec_states", True):
            self.deployed.commit(slots, idx)  # (host lists: on the CPU no tensor is made)
        if self.prefix is not None:
            self._checkpoint_verified(batch, segs, cached)
        return cached

    def _checkpoint_verified(self, batch: list[ScheduledSeq], segs: list[Segment],
                             cached: list[int]) -> None:
        """Checkpoints at boundaries inside the committed part of each verify segment."""
        ckpts, slots, idx = [], [], []
        for s, seg, n in zip(batch, segs, cached):
            if seg.kind == SEG_EXTEND:
                for off, ckpt in self._checkpoints(s.seq, seg.cache_len, n):
                    ckpts.append(ckpt)
                    slots.append(s.seq.slot)
                    idx.append(off)
        if ckpts:
            dev = self.device
            self.deployed.checkpoint_spec(*(torch.tensor(x, device=dev)
                                            for x in (ckpts, slots, idx)))

    def _after_step(self, batch: list[ScheduledSeq], segs: list[Segment], cached: list[int],
                    out: StepOutput) -> None:
        """Hand every sequence that advanced to the draft source."""
        # NOTE: as vLLM's disable_by_batch_size, the running sequences count, prefilling ones
        # too: a batch of requests admitted together does not speculate through the ramp of
        # its chunked prefill once it is running at a batch size where speculation is off
        running = len(self.scheduler.running)
        drafter = isinstance(self.source, ModelDrafter)
        if not drafter and self._spec_off(running):  # no rows to defer: no work to build
            self._count_off(sum(not s.seq.finished and s.seq.num_cached == len(s.seq) - 1
                                for s in batch))
            return
        work, tok = [], 0
        for s, seg, n in zip(batch, segs, cached):
            seq, start = s.seq, seg.cache_len
            if not seq.finished:
                nxt = seq.ids_between(start + 1, start + n + 1)
                if len(nxt) == n:  # mid-prefill chunks know their next tokens; so does a run
                    work.append(DraftWork(seq, start, nxt, (tok, tok + n),
                                          seq.num_cached == len(seq) - 1))
            tok += len(seg.token_ids)
        ctl = self.controller if not isinstance(self.source, FixedDrafter) else None
        wanting = [w.seq for w in work if w.wants]
        if drafter and self._spec_off(running):
            # NOTE: its rows wait for the next drafting step's catch-up, as those of a sequence
            # the controller gives no drafts; a lookup index catches up on its next match
            self._count_off(len(wanting))
            for w in work:
                defer_rows(w, out.hidden)
            return
        if ctl is not None:
            ctl.set_context(sum(seq.num_cached for seq in wanting))
            rest = self._lookup_first(wanting)
            looked = [seq for seq in wanting if seq.spec.drafts]
            # NOTE: the lookup runs before their cut: an upper bound of their rows and tokens
            ctl.plan(rest, sum(1 + len(seq.spec.drafts) for seq in looked), float(len(looked)))
        st, undrafted = self.spec_stats, self.spec_stats.undrafted_steps
        t = time.perf_counter()
        try:
            self.source.propose(work, out.hidden)
        except Exception:  # one sequence's drafting failed: again one by one, it alone fails
            for w in work:
                w.seq.spec.clear()
                try:
                    self.source.propose([w], out.hidden)
                except Exception as e:
                    w.seq.spec.clear()
                    self.fail(w.seq, e)
        if ctl is not None:
            t = time.perf_counter() - t
            if self._fresh_captures():  # (a drafter graph captured: no timing, no overhead)
                self._step_parts = None
            elif ctl.observe_draft(wanting, t) and self._step_parts is not None:
                self._step_parts[1] = t  # modelled by the drafter's cost, not the overhead
        for w in work:
            if w.seq.matcher is not None and w.seq.spec.drafts:
                cut_to_grammar(w.seq)
        if ctl is not None:
            ctl.cut(wanting)
            bare = sum(not seq.spec.drafts for seq in wanting if not seq.finished)
            st.controlled_steps += max(bare - (st.undrafted_steps - undrafted), 0)
        for seq in wanting:
            if not seq.finished:
                st.steps_by_num_drafts[min(len(seq.spec.drafts), self.max_k)] += 1


    def _spec_off(self, batch: int) -> bool:
        """Whether a step with `batch` running sequences runs without speculation
        (`SpecConfig.disable_by_batch_size`, else the controller's `off_batches`). Drafts
        fixed by `fix_drafts` are always verified."""
        if isinstance(self.source, FixedDrafter) or batch < 1:
            return False
        n = self.disable_by_batch_size
        if n is not None:
            return batch > n
        return self.controller is not None and batch in self.controller.off_batches

    def _count_off(self, n: int) -> None:
        """`n` decoding sequences got no drafts: speculation is off at this batch size."""
        self.spec_stats.batch_off_steps += n
        self.spec_stats.steps_by_num_drafts[0] += n

    def _lookup_first(self, seqs: list[Sequence]) -> list[Sequence]:
        """With a drafter, lookup, and the controller: a sequence whose tail matches takes its
        lookup drafts now and leaves the drafter alone this step (`limit` 0: its catch-up is
        deferred), for a match drafts better than a small drafter (README, "N-gram lookup
        drafts") and costs no forward. The others, returned, are the controller's to plan."""
        if self.lookup is None or not isinstance(self.source, ModelDrafter):
            return seqs
        rest = []
        for seq in seqs:
            if not seq.finished and self.lookup.complete(seq, seq.all_ids,
                                                         self.deployed.vocab_size, self.device):
                seq.spec.limit = 0
            else:
                rest.append(seq)
        return rest
