"""States after a few chosen tokens of a chunked scan (prefix-cache checkpoints).

A chunked scan (Mamba2 SSD, gated delta rule) carries one state across chunks; inside chunk c
the state after token i is ``exp(cum_i) · start_c + sum_{j <= i} exp(cum_i - cum_j) · a_j b_j^T``
(SSD: a = dt-scaled x, b = B; gated delta: a = k, b = the solved update u). Two things keep the
checkpoints cheap:
- a token that ends its chunk, or the segment, needs nothing: its state is the next chunk's
  start (or the final state), already computed;
- asked tokens of one chunk are chained: from the previous asked token i' of the same chunk,
  ``S_i = exp(cum_i - cum_i') · S_i' + sum_{i' < j <= i} ...``, so each input token is summed
  once (one pass of state updates over the segment), however many boundaries a chunk holds.
"""
from __future__ import annotations

import torch

from specdeploy.ops import elementwise as ew


def states_at(state_at: torch.Tensor, size: int, t: int, start: torch.Tensor,
              final: torch.Tensor, cum: torch.Tensor, left: torch.Tensor, right: torch.Tensor
              ) -> torch.Tensor:
    """`state_at` [W, 2] host int64 (batch row, token < t); chunk tensors of the scan: `start`
    [B, H, c, X, Y] (state entering each chunk), `final` [B, H, X, Y], `cum` [B, H, c, l],
    `left` [B, H, c, l, X], `right` [B, H, c, l, Y]. Returns [W, H, X, Y] fp32."""
    dev = start.device
    rows, offs = state_at[:, 0].tolist(), state_at[:, 1].tolist()
    out = start.new_empty(len(rows), start.shape[1], *start.shape[3:])
    # NOTE: a segment's last token sits in its last chunk, whose "after" is the final state
    free = [w for w, o in enumerate(offs) if o % size == size - 1 or o == t - 1]
    last_chunk = start.shape[2] - 1
    into_next = [w for w in free if offs[w] // size < last_chunk]
    at_end = [w for w in free if offs[w] // size == last_chunk]
    if into_next:  # the state entering the next chunk
        out[_t(into_next, dev)] = start[_t([rows[w] for w in into_next], dev), :,
                                        _t([offs[w] // size + 1 for w in into_next], dev)]
    if at_end:
        out[_t(at_end, dev)] = final[_t([rows[w] for w in at_end], dev)]
    rest = sorted((w for w in range(len(rows)) if w not in set(free)),
                  key=lambda w: (rows[w], offs[w]))
    if not rest:
        return out
    # chain the asked tokens of each chunk: prev = the asked token before (or the chunk start)
    pos = {w: k for k, w in enumerate(rest)}
    prev, rank, last = [], [], {}
    for w in rest:
        p = last.get((rows[w], offs[w] // size))
        prev.append(p)
        rank.append(0 if p is None else rank[pos[p]] + 1)
        last[(rows[w], offs[w] // size)] = w
    lo = [0 if p is None else offs[p] % size + 1 for p in prev]  # first token of each span
    hi = [offs[w] % size for w in rest]
    span = max(h - lo_ + 1 for h, lo_ in zip(hi, lo))
    r = _t([rows[w] for w in rest], dev)
    c = _t([offs[w] // size for w in rest], dev)
    i = _t(hi, dev)
    j = i[:, None] - torch.arange(span, device=dev)  # [W', span] tokens of each span
    inside = j >= _t(lo, dev)[:, None]
    j = j.clamp(min=0)
    cum_i = cum[r, :, c, i]  # [W', H]
    weight = torch.where(inside[..., None], ew.exp(cum_i[:, None] - cum[r[:, None], :,
                                                                      c[:, None], j]),
                         0.0)  # [W', span, H]
    a = left[r[:, None], :, c[:, None], j] * weight[..., None]  # [W', span, H, X]
    delta = a.permute(0, 2, 3, 1) @ right[r[:, None], :, c[:, None], j].transpose(1, 2)
    base_decay = ew.exp(torch.where(
        _t([p is None for p in prev], dev)[:, None], cum_i,
        cum_i - cum[r, :, c, _t([lo_ - 1 if lo_ else 0 for lo_ in lo], dev)]))
    states = start[r, :, c]  # rank 0 chains from the chunk start; later ranks from prev
    for m in range(max(rank) + 1):
        idx = [k for k, rk in enumerate(rank) if rk == m]
        if m:
            states[_t(idx, dev)] = states[_t([pos[prev[k]] for k in idx], dev)]
        sel = _t(idx, dev)
        states[sel] = base_decay[sel][..., None, None] * states[sel] + delta[sel]
    out[_t(rest, dev)] = states
    return out


def _t(xs, dev) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long if not xs or not isinstance(xs[0], bool)
                        else torch.bool, device=dev)
