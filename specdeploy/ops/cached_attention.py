"""Paged-KV attention over a flattened ragged batch (prefill, chunked prefill, decode, extend).

Layout: q [1, T, Hq, D], k/v [1, T, Hkv, D(v)]; caches [num_pages, page_size, Hkv, D(v)].
Segment s owns tokens cu[s]:cu[s+1] at positions cache_lens[s] + i; its keys live in the pages
page_table[s, :]. New keys are written first, then each query attends to its segment's cached
prefix plus the new keys up to itself. Rejected speculative keys need no undo: the next step
overwrites them because positions come from `cache_lens` (length bookkeeping).

NOTE: `*_host` tensors are CPU copies used only for Python control flow, so a CUDA run never
synchronizes on metadata.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from specdeploy.ops import attention_rows
from specdeploy.ops.attention import attention_mask
from specdeploy.ops.paged_kv import (  # noqa: F401  (re-exported: callers use ca._pages etc.)
    _FP8,
    _SHORT_SEGMENT,
    INVARIANT_ROWS,
    UNIFORM_MAX,
    _bytes,
    _enc,
    _pages,
    _seq_kv,
    _write_kv,
)


@lru_cache(maxsize=256)
def _short_mask(t_q: int, t_k: int, sliding_window: int) -> torch.Tensor:
    """The CPU mask of a short segment, built once: every layer of every verify step at this
    length asks for the same one (read-only; SDPA does not write its mask). Built outside
    inference mode so that a later call with autograd on may use it too."""
    with torch.inference_mode(False):
        return attention_mask(t_q, t_k, sliding_window)


def _sdpa(q, k, v, mask, scale):
    """q [S, Tq, Hq, D], k/v [S, Tk, Hkv, D], mask broadcastable to [S, 1, Tq, Tk]."""
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))
    if rep > 1:
        kf = kf.repeat_interleave(rep, dim=1)
        vf = vf.repeat_interleave(rep, dim=1)
    dt = torch.float32 if q.dtype != torch.float32 else q.dtype
    out = F.scaled_dot_product_attention(
        qf.to(dt), kf.to(dt), vf.to(dt), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).to(q.dtype)


def _decode(q, k_cache, v_cache, page_table, cache_lens, scale, sliding_window):
    """One query per sequence, fully batched. q [S, Hq, D]; page_table [S, P]; returns
    [S, Hq, Dv]. Keys past each sequence's position (unwritten or padding pages) are masked."""
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    keys = _pages(k_cache, page_table)  # [S, P*ps, Hkv, D]
    vals = _pages(v_cache, page_table)
    kpos = torch.arange(keys.shape[1], device=q.device)[None, :]
    masked = kpos > cache_lens[:, None]
    if sliding_window > 0:
        masked = masked | (kpos <= cache_lens[:, None] - sliding_window)
    # NOTE: grouped heads as [S, Hkv, rep, D] @ [S, Hkv, D, L]: no copies of K/V per query head
    dt = torch.float32
    qg = q.view(s, hkv, hq // hkv, d).to(dt)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1).to(dt)).mul_(scale)
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), vals.transpose(1, 2).to(dt))  # [S, Hkv, rep, Dv]
    return out.reshape(s, hq, -1).to(q.dtype)


def extend_uniform(q, k_cache, v_cache, page_table, cache_lens, scale, sliding_window):
    """S segments of n = T / S queries each (a verify step), fully batched as `_decode` is: the
    shapes depend on S, n and the page table's width only, never on host-side lengths, so a
    CUDA graph captured for them replays right (engine/cuda_graphs.py). q [1, T, Hq, D] ->
    [1, T, Hq, Dv]; query i of segment s sits at position cache_lens[s] + i."""
    s = cache_lens.shape[0]
    _, t, hq, d = q.shape
    n, hkv = t // s, k_cache.shape[2]
    keys = _pages(k_cache, page_table)  # [S, L, Hkv, D]
    vals = _pages(v_cache, page_table)
    qpos = cache_lens[:, None] + torch.arange(n, device=q.device)  # [S, n]
    kpos = torch.arange(keys.shape[1], device=q.device)[None, None, :]
    masked = kpos > qpos[:, :, None]  # [S, n, L]
    if sliding_window > 0:
        masked = masked | (kpos <= qpos[:, :, None] - sliding_window)
    dt = torch.float32
    qg = q[0].view(s, n, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).to(dt)  # [S, Hkv, rep, n, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)[:, :, None].to(dt)).mul_(scale)
    scores.masked_fill_(masked[:, None, None], float("-inf"))  # [S, Hkv, rep, n, L]
    out = torch.matmul(scores.softmax(-1), vals.transpose(1, 2)[:, :, None].to(dt))
    return out.permute(0, 3, 1, 2, 4).reshape(1, t, hq, -1).to(q.dtype)


def _decode_one(q, k_cache, v_cache, pages, cache_len, scale, window=0):
    """One sequence's decode query against exactly its cached positions 0..cache_len (no mask;
    the last `window` of them where window > 0). q [1, Hq, D] -> [1, Hq, Dv]."""
    keys, vals = _seq_kv(k_cache, v_cache, pages, cache_len + 1)
    if 0 < window <= cache_len:
        keys, vals = keys[cache_len + 1 - window:], vals[cache_len + 1 - window:]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), keys.transpose(0, 1)[None].float(),
        vals.transpose(0, 1)[None].float(), scale=scale, enable_gqa=True)  # [1, Hq, 1, Dv]
    return out[0].transpose(0, 1).to(q.dtype)


def _rows(q, k_cache, v_cache, pages, pos0, scale, window=0, sinks=None):
    """One sequence's rows at positions pos0.. (q [T, Hq, D] -> [T, Hq, Dv]), each computed on
    its own (batch-invariant; see ops/attention_rows.py): by the C kernel where it fits, else
    by one 1-row SDPA per row. One SDPA over the rows would sum in another order (~1e-7 off a
    1-row call), which the fast kernels' 8-bit activation rounding can blow up into another
    greedy token."""
    if attention_rows.fits(q, k_cache, v_cache):
        return attention_rows.attention_rows(q, k_cache, v_cache, pages, pos0, scale, window,
                                             sinks)
    if sinks is not None:
        raise AssertionError("sinks reach _rows only where the C kernel fits")
    return torch.cat([_decode_one(q[i:i + 1], k_cache, v_cache, pages, pos0 + i, scale, window)
                      for i in range(q.shape[0])])


def _extend_one(q, k_cache, v_cache, pages, total, mask, scale):
    """One sequence's chunk of queries (a prefill chunk or a verify segment), the last
    q.shape[0] of its `total` positions, under `mask` [Tq, total]. q [Tq, Hq, D] -> [Tq, Hq, Dv].
    NOTE: grouped heads through enable_gqa: no per-query-head copies of K and V."""
    keys, vals = _seq_kv(k_cache, v_cache, pages, total)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), keys.transpose(0, 1)[None].float(),
        vals.transpose(0, 1)[None].float(), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)


def _one_call(q, k, v, k_cache, v_cache, cu_host, lens_host, page_table, slot_mapping) -> bool:
    """Whether the step's cache writes and attention can be one C call (`write_attend_rows`:
    the cache writes `_write_kv` makes and the rows `_rows` computes, the same bits)."""
    if (slot_mapping is None or q.device.type != "cpu" or q.dim() != 4 or q.shape[0] != 1
            or any(x.dtype is not torch.float32 for x in (q, k, v))
            or k.shape[2] != k_cache.shape[2] or k.shape[-1] != q.shape[-1]
            or k_cache.shape[-1] != q.shape[-1] or v.shape[-1] != v_cache.shape[-1]
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                             or v.requires_grad))):
        return False
    return (all(x.dtype is torch.int64 and x.is_contiguous() and x.device.type == "cpu"
                for x in (cu_host, lens_host, page_table, slot_mapping))
            and attention_rows.fits(q[0], k_cache, v_cache))


def cached_attention_impl(
    q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens, cache_lens_host,
    page_table, scale, sliding_window, slot_mapping=None, sinks=None,
):
    """`cached_attention`; with sinks only where the C kernel fits (see `cached_attention`)."""
    if _one_call(q, k, v, k_cache, v_cache, cu_seqlens_host, cache_lens_host, page_table,
                 slot_mapping):
        # NOTE: the lengths by pointer, no host loop over sequences: ~1 C call instead of
        # ~10 torch calls and a Python loop, and a CPU graph (engine/cpu_graphs.py) replays it
        t = q.shape[1]
        qk = torch.cat((q[0], k[0]), 1)
        vv = v.reshape(1, t, -1)
        if vv.stride(-1) != 1:
            vv = vv.contiguous()
        return attention_rows.write_attend_rows(qk, vv, 0, k_cache, v_cache, slot_mapping,
                                                cu_seqlens_host, cache_lens_host, page_table,
                                                scale, sliding_window, sinks)[None]
    _write_kv(k, v, k_cache, v_cache, cu_seqlens, cache_lens, page_table, slot_mapping)
    t = q.shape[1]
    num_seqs = cache_lens.shape[0]
    page_size = k_cache.shape[1]
    if t == num_seqs and page_table.device.type == "cpu":
        # NOTE: on the CPU a loop over sequences reading only their used pages (a view when the
        # pages are consecutive) beats gathering every page table row padded to the longest
        return torch.cat([_rows(q[0, i:i + 1], k_cache, v_cache, page_table[i], n, scale,
                                sliding_window, sinks)
                          for i, n in enumerate(cache_lens_host.tolist())])[None]
    if t == num_seqs:  # pure decode: one query per segment
        out = _decode(q[0], k_cache, v_cache, page_table, cache_lens, scale, sliding_window)
        return out[None].contiguous()
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    cu = cu_seqlens_host.tolist()
    lens = cache_lens_host.tolist()
    if page_table.device.type == "cpu":
        # NOTE: batch invariance: the rows of a short segment (a verify step, a decode in a
        # mixed step) go through `_rows` as a 1-row decode does, so each is bit-identical to
        # plain decoding's row at its position. Where the C kernel runs, prefill chunks do
        # too: a prompt's rows are then the same bits however the scheduler cut it into
        # chunks (one SDPA per chunk sums in another order per cut, ~1e-7, which the fast
        # kernels' 8-bit activation rounding blew up into other greedy tokens at batch 16:
        # a logprob moved by 0.3). It costs ~5% of a 1,716-token prefill here. Without the
        # C kernel, longer segments take the one-call path below (a per-row SDPA would not).
        every = attention_rows.fits(q, k_cache, v_cache)
        done = {s for s in range(num_seqs)
                if every or cu[s + 1] - cu[s] <= INVARIANT_ROWS}
        for s in done:
            out[0, cu[s]:cu[s + 1]] = _rows(q[0, cu[s]:cu[s + 1]], k_cache, v_cache,
                                            page_table[s], lens[s], scale, sliding_window,
                                            sinks)
        if len(done) == num_seqs:
            return out
    else:
        done = set()
        n = t // num_seqs
        if page_table.device.type != "cpu" and n <= UNIFORM_MAX and all(
                cu[i + 1] - cu[i] == n for i in range(num_seqs)):
            # NOTE: off the CPU a uniform verify step runs batched (static shapes: CUDA graphs)
            return extend_uniform(q, k_cache, v_cache, page_table, cache_lens, scale,
                                  sliding_window)
    single = [s for s in range(num_seqs) if cu[s + 1] - cu[s] == 1 and s not in done]
    if len(single) > 1:  # the decodes of a mixed step run as one batch
        sel = torch.tensor(single, device=q.device)
        tok = cu_seqlens[sel]
        out[0, tok] = _decode(q[0, tok], k_cache, v_cache, page_table[sel], cache_lens[sel],
                              scale, sliding_window)
    cpu = page_table.device.type == "cpu"
    for s in range(num_seqs):
        a, b = cu[s], cu[s + 1]
        if s in done or (len(single) > 1 and b - a == 1):
            continue
        total = lens[s] + (b - a)
        pages = page_table[s, : (total + page_size - 1) // page_size]
        if cpu and b - a <= _SHORT_SEGMENT:
            mask = _short_mask(b - a, total, sliding_window)
        else:
            mask = attention_mask(b - a, total, sliding_window, q.device)
        if cpu:  # NOTE: same math as _sdpa (bit-identical), minus the K/V gather and GQA copies
            out[0, a:b] = _extend_one(q[0, a:b], k_cache, v_cache, pages, total, mask, scale)
            continue
        keys = _pages(k_cache, pages[None])[:, :total]
        vals = _pages(v_cache, pages[None])[:, :total]
        out[:, a:b] = _sdpa(q[:, a:b], keys, vals, mask, scale)
    return out


def widen_rows(out, q, k_cache, v_cache, cu_host, lens_host, page_table, key_extent_host,
               scale, sliding_window):
    """Redo, in place, the rows of `out` whose query sees keys past itself: token i of the step
    attends to the keys at positions < key_extent_host[i] (a bidirectional block: Gemma 3's
    image tokens see their whole image) instead of <= its own; 0 = causal (left as it is).
    A sliding window still bounds a row from below (transformers: AND(window, OR(causal,
    block))). One SDPA per block (the rows sharing an extent) over its keys: a block's rows
    are always fed together (engine/scheduler.py never ends a chunk inside a block, so its
    keys are all in the cache by now), so their bits do not depend on the rest of the step or
    on where the chunks were cut; a prefix-cache hit ending inside a block is the exception
    (its remaining rows form a smaller call)."""
    ext = key_extent_host.tolist()
    cu, lens = cu_host.tolist(), lens_host.tolist()
    for s in range(len(lens)):
        blocks: dict[int, list[int]] = {}
        for i in range(cu[s], cu[s + 1]):
            if ext[i] > lens[s] + i - cu[s] + 1:
                blocks.setdefault(ext[i], []).append(i)
        if not blocks:
            continue
        # (one read of the segment's keys: a page-table read syncs a CUDA device once)
        keys, vals = _seq_kv(k_cache, v_cache, page_table[s], max(blocks))
        for end, rows in blocks.items():
            pos = torch.tensor([lens[s] + i - cu[s] for i in rows])
            lo = (pos + 1 - sliding_window).clamp_(min=0) if sliding_window > 0 else None
            first = int(lo.min()) if lo is not None else 0
            mask = None
            if lo is not None and int(lo.max()) > first:
                mask = (torch.arange(first, end)[None, :] >= lo[:, None]).to(q.device)
            a, b = rows[0], rows[-1] + 1  # (a block's rows are consecutive tokens)
            o = F.scaled_dot_product_attention(
                q[0, a:b].transpose(0, 1)[None].float(),
                keys[first:end].transpose(0, 1)[None].float(),
                vals[first:end].transpose(0, 1)[None].float(), attn_mask=mask, scale=scale,
                enable_gqa=True)
            out[0, a:b] = o[0].transpose(0, 1).to(out.dtype)
    return out


@torch.library.custom_op(
    "specdeploy::cached_attention", mutates_args=("k_cache", "v_cache"), device_types=None
)
def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor,
    cache_lens: torch.Tensor, cache_lens_host: torch.Tensor, page_table: torch.Tensor,
    scale: float, sliding_window: int = 0, slot_mapping: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, key_extent_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """`key_extent_host` [T] or [0] (host): see `widen_rows`; only graphs of models with
    bidirectional image blocks take it (deploy/passes/insert_cache.py)."""
    out = _cached_attention(q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                            cache_lens_host, page_table, scale, sliding_window, slot_mapping,
                            sinks)
    if key_extent_host is not None and key_extent_host.numel():
        if sinks is not None:
            raise ValueError("cached_attention: bidirectional blocks with sinks are not "
                             "supported")
        widen_rows(out, q, k_cache, v_cache, cu_seqlens_host, cache_lens_host, page_table,
                   key_extent_host, scale, sliding_window)
    return out


def _cached_attention(q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                      cache_lens_host, page_table, scale, sliding_window, slot_mapping, sinks):
    if sinks is not None and not (page_table.device.type == "cpu"
                                  and attention_rows.fits(q, k_cache, v_cache)):
        # attention sinks (gpt-oss) where the C kernel does not fit: the torch paths
        from specdeploy.ops.sink_attention import cached_attention_sinks

        return cached_attention_sinks(
            q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
            cache_lens_host, page_table, scale, sliding_window, slot_mapping, sinks)
    # NOTE: with sinks, the C kernel (fits) takes every segment: every branch below that
    # runs on the CPU ends in `_rows` / `write_attend_rows`, which take the sinks
    return cached_attention_impl(
        q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens, cache_lens_host,
        page_table, scale, sliding_window, slot_mapping, sinks,
    )


@cached_attention.register_fake
def _cached_attention_fake(q, k, v, k_cache, v_cache, *args, **kwargs):
    return q.new_empty(*q.shape[:-1], v.shape[-1])
