"""Verification of a step's drafts against the target, for the whole batch at once.

`verify(target_logits [S, K+1, V], drafts, sampling) -> (num_accepted [S], next_token [S])`:
- greedy rows: the longest prefix of drafts equal to the target's argmax, then the target's
  argmax after it (the bonus token);
- sampled rows: speculative rejection sampling. Draft i is accepted with probability
  min(1, p(d_i) / q(d_i)); at the first rejection the next token is drawn from
  norm(max(0, p - q)) (p itself if that is empty), after a fully accepted run from p at K+1. The
  emitted tokens are then distributed exactly as sampling from p one token at a time.
A row with no drafts is an ordinary sample of its one row, drawn as `sampler.sample` draws it.

Vectorized like gpt-fast's accept: no host synchronisation inside; the caller copies the two
results to the host once per step. Per-request generators draw only their own row's noise (in a
row's order: K uniforms, then one exponential race over the vocabulary), so a seeded request
does not depend on its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specdeploy.engine.request import SamplingParams
from specdeploy.engine.sampler import filter_logits


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, host tensors: ids [S, K] padded with -1 past each row's length,
    lengths [S], and probs [S, K, V] (target vocabulary) — the q each draft was drawn from, or
    None when every row is greedy. K = the longest row (0: nothing drafted). `counts`: the
    lengths as Python ints, for the per-row control flow."""

    ids: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    counts: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.counts:  # built by hand: make the padding -1 (`of` builds it so)
            object.__setattr__(self, "counts", tuple(self.lengths.tolist()))
            pad = torch.arange(self.ids.shape[1])[None] >= self.lengths[:, None]
            object.__setattr__(self, "ids", self.ids.masked_fill(pad, -1))

    @staticmethod
    def of(drafts: list[list[int]], probs: list[torch.Tensor | None] | None = None,
           vocab_size: int = 0) -> Drafts:
        """From per-row draft lists (and per-row q [len, V] or None for greedy rows)."""
        counts = tuple(len(d) for d in drafts)
        k = max(counts, default=0)
        ids = torch.tensor([list(d) + [-1] * (k - len(d)) for d in drafts], dtype=torch.long)
        ids = ids.view(len(drafts), k)
        lengths = torch.tensor(counts, dtype=torch.long)
        q = None
        if probs is not None and any(p is not None for p in probs):
            dev = next(p.device for p in probs if p is not None)
            q = torch.zeros(len(drafts), k, vocab_size, device=dev)
            for i, p in enumerate(probs):
                if p is not None:
                    q[i, :p.shape[0]] = p
        return Drafts(ids, lengths, q, counts)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [S, R, V] → the distributions `sample` draws from (temperature, min-p, top-k, top-p),
    per row's params; greedy rows get temperature 1 (their probabilities are not used)."""
    s, r, v = logits.shape
    dev = logits.device
    temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    scaled = filter_logits((logits.float() / temp[:, None, None]).reshape(s * r, v), params, r)
    return scaled.softmax(-1).reshape(s, r, v)


def verify_greedy(target_ids: torch.Tensor, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [S, K+1]: the target's argmax after each draft (greedy rows only need these,
    not the logits). Returns (num_accepted [S], next_token [S])."""
    k = target_ids.shape[1] - 1
    ids = drafts.ids[:, :k].to(target_ids.device)  # padding (-1) never matches
    num = (ids == target_ids[:, :k]).cumprod(1).sum(1)
    return num, target_ids.gather(1, num[:, None])[:, 0]


@lru_cache(maxsize=256)
def member_rows(num_logits: tuple[int, ...], samples: tuple[bool, ...]
                ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], int]:
    """(each sampling sequence's logit rows of the step, which sequences sample, the most rows
    of one): the same few batch shapes come back step after step (a decode batch, a verify
    batch at K), so they are computed once. Tuples: the cached values are never changed."""
    starts = [0]
    for n in num_logits:
        starts.append(starts[-1] + n)
    live = tuple(i for i, s in enumerate(samples) if s)
    rows = tuple(tuple(range(starts[i], starts[i + 1])) for i in live)
    return rows, live, max((len(r) for r in rows), default=0)


def verify_greedy_lists(argmax: list[int], rows: list[list[int]], drafts: list[list[int]],
                        k1: int) -> tuple[list[int], list[int]]:
    """`verify_greedy` on the host, after the step's one synchronisation (the argmax of every
    logit row, `argmax`): on the CPU a few comparisons in Python cost less than the ~10 torch
    calls (building `Drafts`, an index, cumprod, gather, stack) that compare them there.
    `rows[s]`: sequence s's logit rows; `k1`: the padded row count of the torch path, whose
    padding repeats a sequence's last row (and a draft past its rows meets that row)."""
    num, nxt = [], []
    for r, d in zip(rows, drafts):
        last, k = len(r) - 1, min(len(d), k1 - 1)
        a = 0
        while a < k and d[a] == argmax[r[min(a, last)]]:
            a += 1
        num.append(a)
        nxt.append(argmax[r[min(a, last)]])
    return num, nxt


def verify(target_logits: torch.Tensor, drafts: Drafts, params: list[SamplingParams],
           generators: list[torch.Generator | None], default: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [S, K+1, V] (row j: the target after draft j; rows past a row's length
    are ignored). Returns (num_accepted [S], next_token [S]) on the logits' device."""
    s, k1, _ = target_logits.shape
    dev = target_logits.device
    k = k1 - 1
    num, bonus = verify_greedy(target_logits.argmax(-1), drafts)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return num, bonus
    lengths = drafts.lengths.to(dev)
    valid = torch.arange(k, device=dev)[None] < lengths[:, None]
    ids = drafts.ids[:, :k].to(dev).clamp_min(0)  # padding read as token 0, then masked
    p = target_probs(target_logits, params)
    q = drafts.probs.to(dev) if drafts.probs is not None else p.new_zeros(s, k, p.shape[-1])
    p_d = p[:, :k].gather(-1, ids[..., None])[..., 0]
    q_d = q.gather(-1, ids[..., None])[..., 0]
    u = torch.ones(s, k, device=dev)  # 1: never accepted (padding)
    noise = torch.empty(s, p.shape[-1], device=dev)
    for i, (g, n) in enumerate(zip(generators, drafts.counts)):
        if not greedy[i]:
            gen = g if g is not None else default
            u[i, :n].uniform_(generator=gen)
            noise[i].exponential_(generator=gen)
    accept = (u < (p_d / q_d.clamp_min(1e-20)).clamp(max=1.0)) & valid
    num_s = accept.cumprod(1).sum(1)
    rows = torch.arange(s, device=dev)
    p_at = p[rows, num_s]
    rejected = num_s < lengths
    if k:
        residual = (p_at - q[rows, num_s.clamp(max=k - 1)]).clamp_min(0)
        residual = torch.where(rejected[:, None], residual, p_at)
        empty = residual.sum(-1, keepdim=True) <= 0
        p_at = torch.where(empty, p_at, residual)
    drawn = (p_at / noise).argmax(-1)  # the exponential race: a draw from p_at (unnormalized)
    is_greedy = torch.tensor(greedy, device=dev)
    return torch.where(is_greedy, num, num_s), torch.where(is_greedy, bonus, drawn)
