"""The cost controller's decisions as arithmetic (engine/spec_control.py): how many drafts each
sequence verifies to maximise the modelled tokens per second of a step."""
from __future__ import annotations

from specdeploy.engine.spec_accept import expected_tokens


class DraftAllocator:
    """The step-cost model and allocation of `CostController`, which sets the state read here:
    `cost` (a `CostModel`), `drafter` (draft forwards cost), `overhead` / `overhead_verify`
    (seconds of a step outside the modelled parts, in steps that verify no draft / some;
    `host_s`), `draft_scales` (measured / modelled drafting time by the step's longest chain),
    `fixed_verify` (other sequences' drafts make the step a verify step whatever is allocated)
    and `margin` (the share by which drafter drafts must beat plain decoding)."""

    def host_s(self, verify: bool) -> float:
        """The host work of a step outside its modelled parts: a step that verifies drafts
        promotes recurrent states, checks more rows and hands more to the draft source (on
        hybrid-demo ~0.41 ms against 0.18 ms for a plain step, 2 cores, 2026-12-07; one EMA of
        both priced plain steps ~0.2 ms too high and drafted ones too low). Until a verify step
        has been seen, the one estimate."""
        o = self.overhead_verify
        return o if verify and o is not None else self.overhead

    def _cost(self, rows: int, chain: list[int], draft: bool, behind: int = 0) -> float:
        """A step of `rows` verified rows where `chain[s]` sequences draft more than s drafts:
        the target forward, and with `draft` the drafter's catch-up (about two rows per
        drafting sequence: its last token and an accepted draft, plus `behind` rows that the
        drafting sequences deferred while they drafted nothing) and its chain forwards (k - 1
        for k drafts: the catch-up drafts the first); the host work of a plain or verify step."""
        drafted = draft and self.drafter and chain[0]
        t = self.cost.target_s(rows) + self.host_s(bool(drafted) or self.fixed_verify)
        if drafted:
            scales = self.draft_scales
            n = 1
            while n < len(chain) and chain[n]:  # the longest chain: chain[s] > 0 for s < n
                n += 1
            t += scales[min(n, len(scales) - 1)] * self._draft_s(chain, behind)
        return t

    def _draft_s(self, chain: list[int], behind: int = 0) -> float:
        return self.cost.draft_s(2 * chain[0] + behind) + sum(
            self.cost.draft_s(c) for c in chain[1:] if c)

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
        target_s, over = self.cost.target_s, self.host_s(True)
        best, best_m = tokens / (target_s(rows) + self.host_s(self.fixed_verify)), 0
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
