"""States after a few chosen tokens of a chunked scan (prefix-cache checkpoints).

A chunked scan (Mamba2 SSD, gated delta rule) carries one state across chunks; the state after
token i of chunk c is ``exp(cum_i) · start_c + sum_{j <= i} exp(cum_i - cum_j) · (update j)``.
A token that ends its chunk, or the segment, needs none of that: its state is the next chunk's
start (or the final state), already computed. Others cost one within-chunk sum each.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def states_at(state_at: torch.Tensor, size: int, t: int, start: torch.Tensor,
              final: torch.Tensor, cum: torch.Tensor,
              within: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """`state_at` [W, 2] host int64 (batch row, token < t); `start` [B, H, c, X, Y] the state
    entering each chunk, `final` [B, H, X, Y], `cum` [B, H, c, l] cumulative log decay;
    `within(rows, chunks, i)` -> [W', H, X, Y] the in-chunk sum up to token i. Returns
    [W, H, X, Y] fp32."""
    dev = start.device
    rows, off = state_at[:, 0], state_at[:, 1]
    chunk, i = off // size, off % size
    # NOTE: a segment's last token sits in its last chunk, whose "after" is the final state
    free = (i == size - 1) | (off == t - 1)
    out = start.new_empty(len(rows), *start.shape[1:2], *start.shape[3:])
    if free.any():
        after = torch.cat((start[:, :, 1:], final[:, :, None]), dim=2)
        w = free.nonzero()[:, 0]
        out[w.to(dev)] = after[rows[w].to(dev), :, chunk[w].to(dev)]
    if not free.all():
        w = (~free).nonzero()[:, 0]
        r, c, j = rows[w].to(dev), chunk[w].to(dev), i[w].to(dev)
        out[w.to(dev)] = within(r, c, j) + cum[r, :, c, j].exp()[..., None, None] * start[r, :, c]
    return out
