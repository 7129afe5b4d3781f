"""Batched sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds.

The logits come processed (engine/logits_process.py: grammar, min_tokens, penalties).

All rows are processed together; the only host transfer is the caller's `.tolist()` of the ids.
Sampling uses the exponential race (`argmax(p / q)`, q ~ Exp(1)), which equals a categorical draw
and lets a per-request `torch.Generator` fill just its own row of noise.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdeploy.engine.request import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """logits [N,V] (already temperature-scaled); top_k [N] (0 = all), top_p [N] → masked logits."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    v = logits.shape[-1]
    rank = torch.arange(v, device=logits.device)
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)
    drop = rank[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass *before* it already reaches top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [N,V] (temperature-scaled, as vLLM applies min_p); min_p [N] (0 = off) → masked:
    a token stays when its probability is at least min_p times the top token's."""
    probs = logits.softmax(-1)
    drop = probs < min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(scaled: torch.Tensor, params: Sequence[SamplingParams], repeat: int = 1
                  ) -> torch.Tensor:
    """min_p, then top-k / top-p, on [N * repeat, V] rows (`repeat` rows per request)."""
    dev = scaled.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=scaled.dtype)
        scaled = _filter_min_p(scaled, min_p.repeat_interleave(repeat))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev).repeat_interleave(repeat)
        top_p = torch.tensor([p.top_p for p in params], device=dev,
                             dtype=scaled.dtype).repeat_interleave(repeat)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return scaled


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], default: torch.Generator | None = None
           ) -> torch.Tensor:
    """logits [N,V] fp32, one SamplingParams and generator (None = unseeded) per row → ids [N]."""
    greedy_ids = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_ids
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    scaled = filter_logits(logits / temp[:, None], params)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        # NOTE: one row per generator keeps a seeded request's draws independent of its batch.
        noise[i].exponential_(generator=g if g is not None else default)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=dev)
    return torch.where(is_greedy, greedy_ids, sampled)
