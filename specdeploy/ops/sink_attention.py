"""`cached_attention` for layers with attention sinks (gpt-oss): its torch paths, each with the
sinks' column (ops/attention.py: a zero key whose float-mask value is the head's sink, or an
explicit column before the softmax). `cached_attention` sends calls with sinks here where the C
row kernel (attention_rows.c, which takes sinks) does not fit: off the CPU, other dtypes.

Same cache layout, writes and batch-invariance rule as ops/cached_attention.py: on the CPU a
decode row and every row of a short segment (a verify step) are each one 1-row attention over
exactly their visible keys, so a verify row is bit-identical to plain decoding's row at its
position (lossless greedy speculation); longer segments (prefill chunks) take one masked SDPA.
Off the CPU decodes and uniform verify steps run batched with static shapes (no host sync, CUDA
graphs replay them), as `_decode` / `extend_uniform` do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops import paged_kv as ca  # (the cache plumbing cached_attention shares)
from specdeploy.ops.attention import attention_mask, sink_mask, with_zero_key

__all__ = ["cached_attention_sinks"]


def _attend(q, keys, vals, mask, scale, sinks):
    """q [Tq, Hq, D] against keys / values [L, Hkv, D(v)] under `mask` [Tq, L] (bool), with the
    sinks' column. -> [Tq, Hq, Dv] in q's dtype."""
    qf = q.transpose(0, 1)[None].float()
    kf = with_zero_key(keys.transpose(0, 1)[None].float(), 2)
    vf = with_zero_key(vals.transpose(0, 1)[None].float(), 2)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=sink_mask(mask, sinks)[None],
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)


def _rows(q, k_cache, v_cache, pages, pos0, scale, window, sinks):
    """One sequence's rows at positions pos0.. (q [T, Hq, D]), each attending on its own the
    keys it sees (the last `window` of them where window > 0): batch-invariant."""
    keys, vals = ca._seq_kv(k_cache, v_cache, pages, pos0 + q.shape[0])
    out = []
    for i in range(q.shape[0]):
        end = pos0 + i + 1
        start = max(0, end - window) if window > 0 else 0
        ones = torch.ones(1, end - start, dtype=torch.bool, device=q.device)
        out.append(_attend(q[i:i + 1], keys[start:end], vals[start:end], ones, scale, sinks))
    return torch.cat(out)


def _batched(q, k_cache, v_cache, page_table, cache_lens, scale, window, sinks, n):
    """S segments of n queries each (n = 1: decodes), query i of segment s at position
    cache_lens[s] + i; shapes depend on S, n and the page table's width only.
    q [S * n, Hq, D] -> [S * n, Hq, Dv]."""
    s, hq, d = cache_lens.shape[0], q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    keys = ca._pages(k_cache, page_table)  # [S, L, Hkv, D]
    vals = ca._pages(v_cache, page_table)
    qpos = cache_lens[:, None] + torch.arange(n, device=q.device)  # [S, n]
    kpos = torch.arange(keys.shape[1], device=q.device)[None, None, :]
    masked = kpos > qpos[:, :, None]
    if window > 0:
        masked = masked | (kpos <= qpos[:, :, None] - window)
    dt = torch.float32
    qg = q.view(s, n, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).to(dt)  # [S, Hkv, rep, n, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)[:, :, None].to(dt)).mul_(scale)
    scores.masked_fill_(masked[:, None, None], float("-inf"))  # [S, Hkv, rep, n, L]
    sink = sinks.float().view(1, hkv, hq // hkv, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    out = torch.matmul(probs, vals.transpose(1, 2)[:, :, None].to(dt))
    return out.permute(0, 3, 1, 2, 4).reshape(s * n, hq, -1).to(q.dtype)


def cached_attention_sinks(q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                           cache_lens_host, page_table, scale, sliding_window, slot_mapping,
                           sinks):
    """`cached_attention`'s contract (q [1, T, Hq, D] -> [1, T, Hq, Dv]) with sinks [Hq]."""
    if sinks.shape != (q.shape[2],):
        raise ValueError(f"cached_attention: sinks must be one per query head ({q.shape[2]}), "
                         f"got shape {tuple(sinks.shape)}")
    ca._write_kv(k, v, k_cache, v_cache, cu_seqlens, cache_lens, page_table, slot_mapping)
    t, num_seqs, cpu = q.shape[1], cache_lens.shape[0], page_table.device.type == "cpu"
    cu, lens = cu_seqlens_host.tolist(), cache_lens_host.tolist()
    uniform = all(cu[i + 1] - cu[i] == t // num_seqs for i in range(num_seqs))
    if not cpu and uniform and t // num_seqs <= ca.UNIFORM_MAX:
        return _batched(q[0], k_cache, v_cache, page_table, cache_lens, scale, sliding_window,
                        sinks, t // num_seqs)[None]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    page_size = k_cache.shape[1]
    for s in range(num_seqs):
        a, b = cu[s], cu[s + 1]
        total = lens[s] + (b - a)
        pages = page_table[s, : (total + page_size - 1) // page_size]
        if cpu and b - a <= ca.INVARIANT_ROWS:
            out[0, a:b] = _rows(q[0, a:b], k_cache, v_cache, pages, lens[s], scale,
                                sliding_window, sinks)
            continue
        keys, vals = ca._seq_kv(k_cache, v_cache, pages, total)
        mask = attention_mask(b - a, total, sliding_window, q.device)
        out[0, a:b] = _attend(q[0, a:b], keys, vals, mask, scale, sinks)
    return out
