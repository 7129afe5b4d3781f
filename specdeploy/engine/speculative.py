"""One-model speculative decoding on top of `Engine`: verify → accept → commit → draft.

A step (DESIGN.md invariant 4):
1. Target forward: prefill chunks as usual; every sequence that has drafts feeds one EXTEND
   segment [last accepted token, d_1..d_K] at positions n-1..n-1+K.
2. Verify: greedy = longest prefix of drafts equal to the target's argmax, plus the target's bonus
   token; temperature > 0 = rejection sampling against the drafter's probabilities q (accept d_i
   with prob min(1, p/q), else resample from norm(max(0, p - q))), so outputs follow the target.
3. Commit: KV by length bookkeeping (`num_cached += 1 + accepted`); recurrent state by promoting
   the spec-state entry `accepted` (the state after the last kept token) into the slot.
4. Draft: the drafter catches up on the newly committed positions with the target's captured
   hidden states (pair (h_p, token_{p+1}) at position p), then runs K-1 single-token steps on its
   own hidden state. Its paged KV shares the target's page tables.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.engine.engine import Engine
from specdeploy.engine.lookup import NgramIndex, next_lookup_len
from specdeploy.engine.request import RequestOutput, SamplingParams, Sequence
from specdeploy.engine.sampler import _filter_top_k_top_p
from specdeploy.engine.scheduler import Scheduler


@dataclass
class SpecStats:
    """Acceptance counters. mean accepted length = 1 + accepted / (draft steps + undrafted
    steps): tokens per target forward of a decoding sequence, bonus included."""

    k: int
    max_k: int = 0  # most drafts in one verify segment (lookup may draft more than K); 0: K
    draft_steps: int = 0  # verify segments
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    lookup_steps: int = 0  # verify segments whose drafts came from n-gram lookup
    lookup_accepted_tokens: int = 0
    undrafted_steps: int = 0  # decode steps left without drafts by the confidence stop

    def __post_init__(self):
        self.max_k = max(self.max_k, self.k)
        self.accepted_per_position = [0] * self.max_k

    def as_dict(self) -> dict:
        n = self.draft_steps + self.undrafted_steps
        steps = max(n, 1)
        return {
            "num_draft_tokens": self.k, "draft_steps": self.draft_steps,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / max(self.draft_tokens, 1),
            "mean_accepted_length": 1 + self.accepted_tokens / steps if n else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [a / steps for a in self.accepted_per_position],
            "lookup_steps": self.lookup_steps,
            "lookup_accepted_tokens": self.lookup_accepted_tokens,
            "undrafted_steps": self.undrafted_steps,
        }


class SpecScheduler(Scheduler):
    """A drafting sequence feeds its whole extend segment at once and reserves room for the
    drafter's next K-1 positions."""

    def _want(self, seq: Sequence, budget: int) -> int:
        drafts = getattr(seq, "drafts", None)
        return 1 + len(drafts) if drafts else super()._want(seq, budget)

    def _reserve(self, seq: Sequence, n: int) -> int:
        if getattr(seq, "drafts", None):
            return seq.num_cached + n + self.lookahead - 1
        return super()._reserve(seq, n)

    def preempt(self, seq: Sequence) -> None:
        seq.drafts, seq.draft_probs = [], None  # recomputed from scratch with the prefill
        super().preempt(seq)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from for these params (temperature, top-k, top-p)."""
    scaled = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        n = logits.shape[0]
        scaled = _filter_top_k_top_p(
            scaled, torch.full((n,), params.top_k, device=logits.device),
            torch.full((n,), params.top_p, device=logits.device, dtype=logits.dtype))
    return scaled.softmax(-1)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling. p [K+1, V] target probs, q [K, V] the drafter's probs the
    drafts were drawn from. Returns (accepted drafts, next token); the emitted tokens are
    distributed exactly as sampling from p one token at a time."""
    for a, d in enumerate(drafts):
        ratio = float((p[a, d] / q[a, d].clamp_min(1e-20)).clamp(max=1.0))
        if float(torch.rand((), generator=gen)) >= ratio:
            residual = (p[a] - q[a]).clamp_min(0)
            total = residual.sum()
            return a, _draw(residual / total if total > 0 else p[a], gen)
    return len(drafts), _draw(p[len(drafts)], gen)


class SpecEngine(Engine):
    """`deployed` is a `SpecDeployed`. `draft_override(seq, n) -> list[int]` (tests) replaces the
    drafter's proposals (n: the most drafts a segment may carry), e.g. with the target's own
    greedy tokens. `set_lookup((max n, min n), tokens)` turns on n-gram lookup drafts
    (engine/lookup.py) ahead of the drafter's; a match drafts `tokens` (default K).
    `draft_min_prob` > 0 stops a sequence's drafter chain at the first draft whose chain
    probability (the product of the drafter's top probabilities so far: its own estimate that
    every draft up to there is accepted) falls below it; that draft is dropped. Lossless: the
    stop reads only the drafter's outputs, and the target verifies whatever was drafted."""

    def __init__(self, deployed, tokenizer=None, **kw):
        super().__init__(deployed, tokenizer, **kw)
        self.k = deployed.num_draft_tokens
        spec = getattr(deployed, "spec", None)
        self.scheduler = SpecScheduler(self.blocks, self.scheduler.max_batch_size,
                                       self.scheduler.max_num_tokens)
        max_n = getattr(spec, "prompt_lookup_max", 0)
        self.set_lookup((max_n, spec.prompt_lookup_min) if max_n else None,
                        getattr(spec, "prompt_lookup_num_tokens", None))
        self.draft_override: Callable[[Sequence, int], list[int]] | None = None
        self.draft_min_prob: float = getattr(spec, "draft_min_prob", 0.0)

    def set_lookup(self, lookup: tuple[int, int] | None, num_tokens: int | None = None) -> None:
        """N-gram lookup (max n, min n), None: off; a match drafts up to `num_tokens` (None:
        K), growing from K while lookup runs are accepted whole (`next_lookup_len`). Resets
        the acceptance counters (their per-position list is sized by the longest segment). A
        target with recurrent state holds spec states for the deployed max(K,
        prompt_lookup_num_tokens) drafts only."""
        self.lookup = lookup
        self.lookup_k = (num_tokens or self.k) if lookup else 0
        self.max_k = max(self.k, self.lookup_k)  # the most drafts in one verify segment
        self.scheduler.lookahead = self.max_k
        self.spec_stats = SpecStats(self.k, self.max_k)

    def stats_dict(self) -> dict:
        return {**super().stats_dict(), **self.spec_stats.as_dict()}

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        touched, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        if batch:
            segs = []
            for s in batch:
                seq = s.seq
                if getattr(seq, "drafts", None):
                    ids = seq.pending_ids(1) + seq.drafts
                    segs.append(Segment(ids, seq.num_cached, seq.pages, seq.slot, len(ids),
                                        SEG_EXTEND))
                else:
                    segs.append(Segment(seq.pending_ids(s.num_tokens), seq.num_cached,
                                        seq.pages, seq.slot, int(s.samples)))
            if not any(s.num_logits for s in segs):
                segs[-1].num_logits = 1
            meta = build_metadata(segs).to(self.device)
            tf = time.perf_counter()
            out = self.deployed.forward(meta)
            now = time.perf_counter()
            work = self._verify_and_commit(batch, segs, out.logits, now, touched)
            self._draft(work, out.hidden)
            self.stats.forward_time_s += time.perf_counter() - tf
            self._count_step(meta.num_tokens, len(batch))
        return self._emit(touched, t0)

    # ---- verification ---------------------------------------------------------------------------
    def _verify_and_commit(self, batch, segs, logits, now, touched) -> list[tuple]:
        """Returns drafter work: (seq, first position, next tokens, hidden row range, wants)."""
        row, tok = 0, 0
        work = []
        commit_slots, commit_idx = [], []
        for s, seg in zip(batch, segs):
            seq, n = s.seq, len(seg.token_ids)
            rows = logits[row:row + seg.num_logits]
            row += seg.num_logits
            start = seq.num_cached
            if seg.kind == SEG_EXTEND:
                kept = self._accept(seq, rows)
                seq.num_cached += len(kept)  # last token + accepted drafts (bonus is pending)
                commit_slots.append(seq.slot)
                commit_idx.append(len(kept) - 1)
                self._append(seq, kept[1:] + [self._bonus], now)
                span, rows_used = len(kept), (tok, tok + len(kept))
            else:
                samples = s.samples  # NOTE: read before num_cached moves
                seq.num_cached += n
                if samples:
                    t = self._sample_one(seq, rows[-1:])
                    self._append(seq, [t], now)
                span, rows_used = n, (tok, tok + n)
            touched.append(seq)
            tok += n
            if not seq.finished:
                nxt = seq.all_ids[start + 1:start + span + 1]
                if len(nxt) == span:  # mid-prefill chunks know their next tokens; so does a run
                    work.append((seq, start, nxt, rows_used, seq.num_cached == len(seq) - 1))
        if commit_slots:
            dev = self.device
            self.deployed.commit(torch.tensor(commit_slots, device=dev),
                                 torch.tensor(commit_idx, device=dev))
        return work

    def _sample_one(self, seq: Sequence, rows: torch.Tensor) -> int:
        if seq.params.greedy:
            return int(rows[0].argmax())
        gen = seq.generator or self.generator
        return _draw(target_probs(rows.float(), seq.params)[0], gen)

    def _accept(self, seq: Sequence, rows: torch.Tensor) -> list[int]:
        """rows [K+1, V]. Returns [last token, accepted drafts...]; sets self._bonus."""
        drafts = seq.drafts
        kept = [seq.all_ids[-1]]
        st = self.spec_stats
        st.draft_steps += 1
        st.draft_tokens += len(drafts)
        if seq.params.greedy:
            target = rows.argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == target[a]:
                a += 1
            self._bonus = target[a]
        else:
            p = target_probs(rows.float(), seq.params)
            a, self._bonus = rejection_sample(p, seq.draft_probs, drafts,
                                              seq.generator or self.generator)
        st.accepted_tokens += a
        if getattr(seq, "drafts_from_lookup", False):
            st.lookup_steps += 1
            st.lookup_accepted_tokens += a
            seq.lookup_n = next_lookup_len(getattr(seq, "lookup_n", self.k), a == len(drafts),
                                           self.k, self.lookup_k)
        for i in range(a):
            st.accepted_per_position[i] += 1
        return kept + drafts[:a]

    # ---- drafting -------------------------------------------------------------------------------
    def _draft(self, work: list[tuple], captured: torch.Tensor) -> None:
        for seq, *_ in work:
            seq.drafts, seq.draft_probs, seq.drafts_from_lookup = [], None, False
        if not work:
            return
        if self.deployed.draft is None:  # method="ngram": lookup drafts only
            self._lookup_only([seq for seq, *_, wants in work if wants])
            return
        d = self.deployed
        hidden = d.project(captured[torch.cat([torch.arange(a, b) for *_, (a, b), _ in work])])
        segs = [Segment(nxt, start, seq.pages, seq.slot, int(wants))
                for seq, start, nxt, _, wants in work]
        drafting = [(seq, start + len(nxt)) for seq, start, nxt, _, wants in work if wants]
        if not any(s.num_logits for s in segs):
            segs[-1].num_logits = 1
        out = d.draft_forward(build_metadata(segs).to(self.device), hidden)
        if not drafting:
            return
        logits, h = out.logits[: len(drafting)], out.hidden[: len(drafting)]
        everyone = drafting
        committed = {id(seq): seq.all_ids for seq, _ in drafting} if self.lookup else {}
        for step in range(self.k):
            if self.lookup is not None:
                # A sequence whose tail (drafts included) occurred before takes the rest of its
                # drafts from there and leaves the drafter. NOTE: the drafter's catch-up above
                # ran for it anyway (its KV must hold every committed position); its later
                # steps only write positions that the next catch-up overwrites.
                keep = [i for i, (seq, _) in enumerate(drafting)
                        if not self._lookup_drafts(seq, committed[id(seq)])]
                if len(keep) < len(drafting):
                    rows = torch.tensor(keep, dtype=torch.long, device=logits.device)
                    drafting = [drafting[i] for i in keep]
                    logits, h = logits[rows], h[rows]
            if not drafting:
                break
            ids = self._propose(drafting, logits)
            going = self._confident(drafting, logits, step)
            for (seq, _), t, p, ok in zip(drafting, *ids, going):
                if not ok:
                    continue
                seq.drafts.append(t)
                if p is not None:
                    seq.draft_probs = p[None] if seq.draft_probs is None else torch.cat(
                        (seq.draft_probs, p[None]))
            if not all(going):
                # NOTE: a sequence left without drafts decodes plainly next step
                self.spec_stats.undrafted_steps += sum(not seq.drafts for seq, _ in drafting)
                keep = [i for i, ok in enumerate(going) if ok]
                rows = torch.tensor(keep, dtype=torch.long, device=logits.device)
                drafting = [drafting[i] for i in keep]
                h = h[rows]
            if step == self.k - 1 or not drafting:
                break
            segs = [Segment([seq.drafts[-1]], pos + step, seq.pages, seq.slot, 1)
                    for seq, pos in drafting]
            out = d.draft_forward(build_metadata(segs).to(self.device), h)
            logits, h = out.logits, out.hidden
        if self.draft_override is not None:
            for seq, _ in everyone:
                seq.drafts = list(self.draft_override(seq, self.max_k))

    def _lookup_only(self, drafting: list[Sequence]) -> None:
        """No drafter: a sequence whose tail occurred before drafts from there; the others
        decode plainly next step (counted as undrafted steps)."""
        for seq in drafting:
            if self.draft_override is not None:
                seq.drafts = list(self.draft_override(seq, self.max_k))
            elif self.lookup is None or not self._lookup_drafts(seq, seq.all_ids):
                self.spec_stats.undrafted_steps += 1

    def _confident(self, drafting, logits: torch.Tensor, step: int) -> list[bool]:
        """Per drafting sequence: does its chain go on with this step's draft (draft_min_prob)?
        The chain probability is the product of the drafter's top probabilities so far."""
        if not self.draft_min_prob:
            return [True] * len(drafting)
        top = logits.float().softmax(-1).amax(-1).tolist()
        going = []
        for (seq, _), p in zip(drafting, top):
            seq.draft_chain_prob = p * (seq.draft_chain_prob if step else 1.0)
            going.append(seq.draft_chain_prob >= self.draft_min_prob)
        return going

    def _lookup_drafts(self, seq: Sequence, ids: list[int]) -> bool:
        """Complete `seq.drafts` from n-gram lookup when the tail of the sequence (`ids`, its
        committed tokens) plus its drafts occurred before. Lookup drafts are deterministic
        given the prefix: for a sampled request q is one-hot on each (rejection sampling then
        accepts d with probability p(d) and resamples from p without d), so the output still
        follows the target."""
        index = getattr(seq, "ngram_index", None)
        if index is None or (index.max_n, index.min_n) != self.lookup:
            index = seq.ngram_index = NgramIndex(*self.lookup)
        n = min(getattr(seq, "lookup_n", self.k), self.lookup_k)
        if n <= len(seq.drafts):
            return False
        rest = index.propose(ids, n - len(seq.drafts), seq.drafts)
        if rest is None:
            return False
        seq.drafts, seq.drafts_from_lookup = seq.drafts + rest, True
        if not seq.params.greedy:
            n, dev = len(rest), self.device
            q = torch.zeros(n, self.deployed.vocab_size, device=dev)
            q[torch.arange(n, device=dev), torch.tensor(rest, device=dev)] = 1.0
            seq.draft_probs = q if seq.draft_probs is None else torch.cat((seq.draft_probs, q))
        return True

    def _propose(self, drafting, logits: torch.Tensor):
        """Draft ids (target vocabulary) and, for sampled requests, q over the target vocab."""
        d = self.deployed
        greedy_ids = d.to_target(logits.argmax(-1)).tolist()
        ids, probs = [], []
        for i, (seq, _) in enumerate(drafting):
            if seq.params.greedy:
                ids.append(greedy_ids[i])
                probs.append(None)
                continue
            q = d.target_probs((logits[i:i + 1].float() / seq.params.temperature).softmax(-1))[0]
            ids.append(_draw(q, seq.generator or self.generator))
            probs.append(q)
        return ids, probs
