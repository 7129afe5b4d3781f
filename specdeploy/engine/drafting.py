"""Draft sources: what proposes the drafts that the next step verifies.

After each step the engine hands every sequence that advanced to its source as a `DraftWork`
(the positions it fed, the tokens that follow them, its rows in the captured hidden states, and
whether it decodes next and so wants drafts). A source sets `seq.spec.drafts` (and, for sampled
requests, `seq.spec.draft_probs`: the q each draft was drawn from) of the sequences that want
them; a sequence left without drafts decodes plainly.

- `ModelDrafter` (EAGLE-3 / MTP): the drafter catches up on the newly committed positions with
  the target's captured hidden states, then chains single-token steps on its own hidden state;
  with n-gram lookup on, a sequence whose tail occurred before takes the rest from there.
- `LookupDrafter` (`method="ngram"`): lookup only.
- `FixedDrafter`: drafts from a function (tests, benches), with one-hot q for sampled requests.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.engine.lookup import Lookup
from specdeploy.engine.request import Sequence
from specdeploy.engine.sampler import argmax_rows
from specdeploy.engine.spec_control import cut_drafts
from specdeploy.ops.cached_attention import UNIFORM_MAX


class DraftWork(NamedTuple):
    seq: Sequence
    start: int  # first position fed this step
    next_ids: list[int]  # the token after each fed position (all committed)
    rows: tuple[int, int]  # its rows in the step's captured hidden states
    wants: bool  # decodes next step: wants drafts


class DraftSource(Protocol):
    def propose(self, work: list[DraftWork], captured: torch.Tensor | None) -> None: ...


class LookupDrafter:
    """N-gram lookup drafts only; a sequence with no match decodes plainly (`undrafted`)."""

    def __init__(self, lookup: Lookup | None, vocab_size: int, device, stats):
        self.lookup, self.vocab_size, self.device, self.stats = lookup, vocab_size, device, stats

    def propose(self, work: list[DraftWork], captured: torch.Tensor | None) -> None:
        for w in work:
            if w.wants and (self.lookup is None or not self.lookup.complete(
                    w.seq, w.seq.all_ids, self.vocab_size, self.device)):
                self.stats.undrafted_steps += 1


class FixedDrafter:
    """`fn(seq, max_drafts) -> list[int]` proposes. `inner` (the deployment's own source) runs
    first so a drafter's KV stays current; its drafts are then replaced. The drafts are
    deterministic, so q is one-hot for sampled requests."""

    def __init__(self, fn: Callable[[Sequence, int], list[int]], max_drafts: int, vocab_size: int,
                 device, stats, inner: DraftSource | None = None):
        self.fn, self.max_drafts, self.vocab_size, self.device = fn, max_drafts, vocab_size, device
        self.stats, self.inner = stats, inner

    def propose(self, work: list[DraftWork], captured: torch.Tensor | None) -> None:
        if self.inner is not None:
            undrafted = self.stats.undrafted_steps  # the inner source's drafts do not count
            self.inner.propose(work, captured)
            self.stats.undrafted_steps = undrafted
        for w in work:
            if not w.wants:
                continue
            st = w.seq.spec
            st.clear()
            st.drafts = [int(t) for t in self.fn(w.seq, self.max_drafts)][:self.max_drafts]
            if st.drafts and not w.seq.params.greedy:
                n = len(st.drafts)
                q = torch.zeros(n, self.vocab_size, device=self.device)
                q[torch.arange(n), torch.tensor(st.drafts)] = 1.0
                st.draft_probs = q


class ModelDrafter:
    """EAGLE-3 / MTP drafts from the deployed drafter program (`SpecDeployed.draft_forward`).

    `min_prob` > 0 stops a sequence's chain at the first draft whose chain probability (the
    product of the drafter's top probabilities so far: its own estimate that every draft up to
    there is accepted) falls below it; that draft is dropped. Lossless: the stop reads only the
    drafter's outputs, and the target verifies whatever was drafted."""

    def __init__(self, deployed, k: int, lookup: Lookup | None, min_prob: float, stats,
                 generator: torch.Generator):
        self.d, self.k, self.lookup, self.min_prob = deployed, k, lookup, min_prob
        self.stats, self.generator = stats, generator
        self.device = deployed.device
        self.on_device = True  # `_chain_on_device` where it can (False: the host chain)

    def propose(self, work: list[DraftWork], captured: torch.Tensor | None) -> None:
        if not work:
            return
        d = self.d
        # A sequence the controller gives no drafter drafts (`limit` 0) defers its catch-up:
        # its rows wait (`spec.behind`) for its next drafting step, whose catch-up feeds them
        # first. NOTE: with prefix caching its pages may register before the drafter's rows are
        # written; a request that hits them gets worse drafts, never other output.
        later = [w for w in work if w.wants and w.seq.spec.limit == 0]
        for w in later:
            defer_rows(w, captured)
            if self.lookup is not None:  # it still takes a lookup match: that costs no forward
                self.lookup.complete(w.seq, w.seq.all_ids, d.vocab_size, self.device)
        work = [w for w in work if not (w.wants and w.seq.spec.limit == 0)]
        if not work:
            return
        segs, pieces = [], []
        for w in work:
            a, b = w.rows
            start, ids, rows = w.start, w.next_ids, captured[a:b]
            if w.seq.spec.behind is not None:
                start, old, feats = w.seq.spec.behind
                ids, rows, w.seq.spec.behind = old + list(ids), torch.cat((*feats, rows)), None
            # NOTE: `mm`: the drafter sees the target's (multimodal RoPE) positions
            segs.append(Segment(ids, start, w.seq.pages, w.seq.slot, int(w.wants), mm=w.seq.mm))
            pieces.append(rows)
        if not any(s.num_logits for s in segs):
            segs[-1].num_logits = 1
        n = self._uniform_catch_up(segs) if all(w.wants for w in work) else 0
        feats = d.project(torch.cat(pieces))
        drafting = [(w.seq, w.start + len(w.next_ids)) for w in work if w.wants]
        # hist[:, r]: the hidden input of chain row r (at position pos + r, fed draft r + 1)
        if n:  # in replayed pieces: each sequence's last row
            logits, hist = self._catch_up_pieces(segs, feats, n)
        else:
            # the catch-up: every committed position enters the drafter's KV, that of every
            # group of a multi-group MTP module (each group's later steps attend over them too)
            meta = build_metadata(segs)
            out = d.draft_forward(meta, feats)
            for g in range(1, getattr(d, "num_groups", 1)):
                d.draft_forward(meta, feats, group=g)
            logits, hist = out.logits[:len(drafting)], out.hidden[:len(drafting), None]
        if self._chain_on_device(drafting, logits, hist[:, -1]):
            return
        fed = {}  # group -> chain rows its KV holds
        committed = {id(seq): seq.all_ids for seq, _ in drafting} if self.lookup else {}
        for step in range(self.k):
            if self.lookup is not None:
                # NOTE: a sequence that takes the rest of its drafts from lookup leaves the
                # drafter; the catch-up above ran for it anyway (its KV must hold every
                # committed position), its later steps would only write positions that the next
                # catch-up overwrites.
                keep = [i for i, (seq, _) in enumerate(drafting) if not self.lookup.complete(
                    seq, committed[id(seq)], d.vocab_size, self.device)]
                if len(keep) < len(drafting):
                    drafting, logits, hist = self._keep(drafting, keep, logits, hist)
            if not drafting:
                break
            going = self._draft(drafting, logits, step)  # the drafter forward's one host sync
            # the controller's limit: a chain that has its drafts stops (not "undrafted")
            going = [g and (seq.spec.limit is None or len(seq.spec.drafts) < seq.spec.limit)
                     for g, (seq, _) in zip(going, drafting)]
            if not all(going):
                # NOTE: a sequence left without drafts decodes plainly next step
                self.stats.undrafted_steps += sum(not seq.spec.drafts for seq, _ in drafting)
                drafting, logits, hist = self._keep(
                    drafting, [i for i, ok in enumerate(going) if ok], logits, hist)
            if step == self.k - 1 or not drafting:
                break
            # draft step `step + 1` runs its group over the chain rows it has not seen yet
            # (every row but the newest when the group changes), so its attention sees what
            # the module's own causal forward over [committed rows, chain rows] would
            g = d.group_of(step + 1) if hasattr(d, "group_of") else 0
            first = fed.get(g, 0)
            segs = [Segment(seq.spec.drafts[first:step + 1], pos + first, seq.pages, seq.slot, 1,
                            mm=seq.mm) for seq, pos in drafting]
            out = d.draft_forward(build_metadata(segs),
                                  hist[:, first:].reshape(-1, hist.shape[-1]), group=g)
            fed[g] = step + 1
            logits, hist = out.logits, torch.cat((hist, out.hidden[:, None]), 1)

    def _chain_on_device(self, drafting, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
        """The chain with no host sync between its steps: each step's draft (the argmax, in
        the target's ids) is fed to the next step's graph on the device (the runner's `ids`),
        and the drafts come back in one copy at the end. Taken where that is all the chain
        does: greedy requests without images (their chain steps' multimodal positions come
        with their segments), no `min_prob` stop, no lookup, one drafter group whose graphs
        replay the chain steps (engine/cuda_graphs.install(drafts=True)). Each sequence keeps
        the drafts up to its controller limit, as the step-by-step chain would draft them.
        False: not taken (nothing has run)."""
        d = self.d
        progs = getattr(d, "drafts", ())
        if (not self.on_device or self.min_prob or self.lookup is not None or len(progs) != 1
                or getattr(progs[0], "graph_runner", None) is None or not drafting
                or not all(seq.params.greedy and seq.mm is None for seq, _ in drafting)):
            return False
        want = [self.k if seq.spec.limit is None else min(self.k, seq.spec.limit)
                for seq, _ in drafting]
        ids = d.to_target(logits.argmax(-1))
        steps = [ids]
        for step in range(1, max(want)):  # draft step + 1 from draft step's token and hidden
            meta = build_metadata([Segment([0], pos + step - 1, seq.pages, seq.slot, 1)
                                   for seq, pos in drafting])
            out = d.draft_forward(meta, hidden, ids=ids)
            hidden, ids = out.hidden, d.to_target(out.logits.argmax(-1))
            steps.append(ids)
        host = torch.stack(steps, 1).tolist()  # the chain's one host synchronisation
        for (seq, _), row, n in zip(drafting, host, want):
            seq.spec.drafts.extend(int(t) for t in row[:n])
        return True

    def _pieces(self, n: int) -> list[int]:
        """A catch-up of n rows as replayed pieces, longest first, of lengths 1..K + 1 (a
        verify step's) or powers of two: a few graph shapes per page width (each captured on
        first use), however many rows the controller's deferrals leave."""
        sizes = sorted({*range(1, self.k + 2), *(1 << i for i in range(6))}, reverse=True)
        out = []
        while n:
            out.append(next(z for z in sizes if z <= n))
            n -= out[-1]
        return out

    def _catch_up_pieces(self, segs: list[Segment], feats: torch.Tensor, n: int):
        """The catch-up of S sequences feeding n rows each, as pieces in order (each writes its
        rows' KV, the next attends over them: the causal forward of all n at once); a piece of
        z > 1 rows is an EXTEND step with every row's logits, of 1 a decode step. Returns each
        sequence's last-row logits and hidden [S, 1, H]."""
        d, rows, start = self.d, feats.view(len(segs), n, -1), 0
        for z in self._pieces(n):
            piece = [Segment(s.token_ids[start:start + z], s.cache_len + start, s.pages, s.slot,
                             z, SEG_EXTEND if z > 1 else SEG_NORMAL) for s in segs]
            meta = build_metadata(piece)
            part = rows[:, start:start + z].reshape(-1, rows.shape[-1])
            out = d.draft_forward(meta, part)
            for g in range(1, getattr(d, "num_groups", 1)):
                d.draft_forward(meta, part, group=g)
            start += z
        return out.logits[z - 1::z], out.hidden[z - 1::z, None]

    def _uniform_catch_up(self, segs: list[Segment]) -> int:
        """n when a catch-up can replay as CUDA graphs: the drafter programs have graphs
        (engine/cuda_graphs.install(drafts=True)) and no recurrent state (an EXTEND step would
        leave it alone), every sequence wants drafts and feeds n (2..64) tokens after
        a cached prefix; else 0 (eager, one logit a sequence). It then runs in pieces
        (`_catch_up_pieces`), every row's logits computed and the last one taken: the rest cost
        a drafter's small head, not a step."""
        progs = getattr(self.d, "drafts", ())
        if not progs or any(getattr(p, "graph_runner", None) is None or p.layout.recurrent
                            for p in progs):
            return 0
        n = len(segs[0].token_ids)
        if not 1 < n <= 2 * UNIFORM_MAX:  # longer: the end of a prefill, one eager forward
            return 0
        ok = all(len(s.token_ids) == n and s.num_logits == 1 and s.cache_len > 0
                 and s.mm is None for s in segs)
        return n if ok else 0

    @staticmethod
    def _keep(drafting, keep: list[int], logits, hist):
        idx = torch.tensor(keep, dtype=torch.long, device=logits.device)
        return [drafting[i] for i in keep], logits[idx], hist[idx]

    def _draft(self, drafting, logits: torch.Tensor, step: int) -> list[bool]:
        """Append each sequence's next draft (target ids; for sampled requests drawn from the
        drafter's q, kept as q over the target vocabulary). Returns whether each chain goes on
        (`min_prob`); a chain that stops does not take this step's draft."""
        d = self.d
        ids = d.to_target(argmax_rows(logits))
        sampled = [i for i, (seq, _) in enumerate(drafting) if not seq.params.greedy]
        q = None
        if sampled:
            temp = torch.tensor([drafting[i][0].params.temperature for i in sampled],
                                device=logits.device)
            q = d.target_probs((logits[sampled].float() / temp[:, None]).softmax(-1))
            noise = torch.empty_like(q)
            for r, i in enumerate(sampled):
                g = drafting[i][0].generator
                noise[r].exponential_(generator=g if g is not None else self.generator)
            ids = ids.index_copy(0, torch.tensor(sampled, device=ids.device),
                                 (q / noise).argmax(-1))
        if self.min_prob:  # the ids and the chain's probabilities in one copy
            top = logits.float().softmax(-1).amax(-1).double()
            host = torch.stack((ids.double(), top)).tolist()
        else:
            host = [ids.tolist()]
        going = [True] * len(drafting)
        q_row = {i: r for r, i in enumerate(sampled)}
        for i, (seq, _) in enumerate(drafting):
            st = seq.spec
            if self.min_prob:
                st.chain_prob = host[1][i] * (st.chain_prob if step else 1.0)
                going[i] = st.chain_prob >= self.min_prob
                if not going[i]:
                    continue
            st.drafts.append(int(host[0][i]))
            if i in q_row:
                row = q[q_row[i]][None]
                st.draft_probs = row if st.draft_probs is None else torch.cat((st.draft_probs,
                                                                                 row))
        return going


def defer_rows(w: DraftWork, captured: torch.Tensor) -> None:
    """Keep a work item's captured rows for the sequence's next catch-up (copied: the step's
    buffer is the next step's). `behind` = (first position, token ids, [rows per step]): the
    rows are concatenated once, at the catch-up (not every step: a growing copy)."""
    st, (a, b) = w.seq.spec, w.rows
    rows = captured[a:b].clone()
    if st.behind is None:
        st.behind = (w.start, list(w.next_ids), [rows])
    else:
        _, ids, feats = st.behind
        ids.extend(w.next_ids)
        feats.append(rows)


def cut_to_grammar(seq: Sequence) -> None:
    """Drop the drafts from the first one the sequence's grammar forbids (verifying fewer
    drafts is still exact; a forbidden one could only be rejected). The committed grammar
    state is not moved: accepted tokens advance it in `_append`, rejected drafts never did."""
    n = len(seq.matcher.walk(seq.spec.drafts)) - 1
    if n < len(seq.spec.drafts):
        cut_drafts(seq.spec, n)
