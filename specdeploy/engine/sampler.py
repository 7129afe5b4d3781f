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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, the same ids (ties: the first; a NaN row: its first NaN). On a CPU fp32
    tensor through numpy, whose argmax over a 49,152-token row takes ~3 us where torch's takes
    ~43 (torch 2.13, 2026-12-04): ~1% of a decode step of the default model, once per step."""
    if x.device.type == "cpu" and x.dtype is torch.float32 and x.dim() >= 1 and x.shape[-1]:
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.argmax(-1)


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
    c = row_tensors(params, scaled.device, scaled.dtype)
    return _filter(scaled, c, repeat)


def row_tensors(params: Sequence[SamplingParams], device, dtype=torch.float32) -> dict:
    """The per-row tensors sampling reads: temperatures, greedy rows, and min_p / top-k / top-p
    where a row uses them. Each is a host-to-device copy, which on a GPU waits for the work
    queued before it: a burst of decode steps (engine/decode_burst.py) builds them once."""
    c = {"temp": torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                              device=device),
         "greedy": torch.tensor([p.greedy for p in params], device=device)}
    if any(p.min_p > 0 for p in params):
        c["min_p"] = torch.tensor([p.min_p for p in params], device=device, dtype=dtype)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        c["top_k"] = torch.tensor([p.top_k for p in params], device=device)
        c["top_p"] = torch.tensor([p.top_p for p in params], device=device, dtype=dtype)
    return c


def _filter(scaled: torch.Tensor, c: dict, repeat: int = 1) -> torch.Tensor:
    if "min_p" in c:
        scaled = _filter_min_p(scaled, c["min_p"].repeat_interleave(repeat))
    if "top_k" in c:
        scaled = _filter_top_k_top_p(scaled, c["top_k"].repeat_interleave(repeat),
                                     c["top_p"].repeat_interleave(repeat))
    return scaled


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], default: torch.Generator | None = None,
           rows: dict | None = None) -> torch.Tensor:
    """logits [N,V] fp32, one SamplingParams and generator (None = unseeded) per row → ids [N].
    `rows`: `row_tensors(params, ...)` built beforehand (the same draws either way)."""
    greedy_ids = argmax_rows(logits)
    if all(p.greedy for p in params):
        return greedy_ids
    c = rows if rows is not None else row_tensors(params, logits.device, logits.dtype)
    scaled = _filter(logits / c["temp"][:, None], c)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        # NOTE: one row per generator keeps a seeded request's draws independent of its batch.
        noise[i].exponential_(generator=g if g is not None else default)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(c["greedy"], greedy_ids, sampled)
