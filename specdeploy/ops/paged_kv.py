"""The paged KV cache's plumbing shared by the attention ops (ops/cached_attention.py, ops/
sink_attention.py): cache writes, page gathers, one sequence's keys, and the row-count bounds of
the batch-invariant paths. Its own module so that the two ops can share it without importing
each other."""
from __future__ import annotations

import torch

INVARIANT_ROWS = 16  # CPU segments up to here attend row by row (`_rows`: batch-invariant)
_SHORT_SEGMENT = 32  # verify segments up to here reuse one CPU mask across layers and steps
UNIFORM_MAX = _SHORT_SEGMENT  # off the CPU, uniform steps of segments up to here: extend_uniform


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as index ops can address it: an FP8 KV cache (a checkpoint's
    `kv_cache_quant_algo: FP8`) through a uint8 view, as CPU index kernels lack float8."""
    return cache.view(torch.uint8) if cache.dtype in _FP8 else cache


def _enc(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New keys / values in the cache's storage dtype (float8 saturates at its largest value)."""
    y = x.to(cache.dtype)
    return y.view(torch.uint8) if cache.dtype in _FP8 else y


def value_in_key(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the value cache is a view of the key cache's leading dims (cache/handlers.py
    PagedKV.value_in_key: MLA's latent, whose values are its keys' first dims): writing the
    keys writes the values."""
    return v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[-1] <= k_cache.shape[-1]


def _write_kv(k, v, k_cache, v_cache, cu_seqlens, cache_lens, page_table, slot_mapping=None):
    shared = value_in_key(k_cache, v_cache)
    if slot_mapping is not None:  # flat cache rows, computed once per step for every layer
        kb, vb = _bytes(k_cache), _bytes(v_cache)
        kb.view(-1, *kb.shape[2:]).index_copy_(0, slot_mapping, _enc(k[0], k_cache))
        if not shared:
            vb.view(-1, *vb.shape[2:]).index_copy_(0, slot_mapping, _enc(v[0], v_cache))
        return
    t = k.shape[1]
    num_seqs = cache_lens.shape[0]
    page_size = k_cache.shape[1]
    seg = torch.repeat_interleave(
        torch.arange(num_seqs, device=k.device), cu_seqlens.diff(), output_size=t
    )
    pos = cache_lens[seg] + torch.arange(t, device=k.device) - cu_seqlens[seg]
    page = page_table[seg, pos // page_size]
    off = pos % page_size
    _bytes(k_cache)[page, off] = _enc(k[0], k_cache)
    if not shared:
        _bytes(v_cache)[page, off] = _enc(v[0], v_cache)


def _pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """[S, P] page ids → [S, P*page_size, H, D]. NOTE: index_select copies whole pages and is
    several times faster than advanced indexing with a 2-D index."""
    s, p = page_table.shape
    pages = _bytes(cache).index_select(0, page_table.reshape(-1)).view(cache.dtype)
    return pages.view(s, p * cache.shape[1], *cache.shape[2:])


def _seq_kv(k_cache, v_cache, pages, total):
    """One sequence's keys and values at positions 0..total-1 ([total, Hkv, D] each).
    Consecutive pages (the common case: pages are handed out in order) are read through a view
    of the cache; otherwise only the used pages are gathered."""
    ps = k_cache.shape[1]
    n = (total + ps - 1) // ps
    used = pages[:n].tolist()
    first = used[0]
    if used[-1] - first == n - 1 and used == list(range(first, first + n)):
        keys = k_cache.view(-1, *k_cache.shape[2:])[first * ps:first * ps + total]
        vals = v_cache.view(-1, *v_cache.shape[2:])[first * ps:first * ps + total]
        return keys, vals
    return (_pages(k_cache, pages[None, :n])[0, :total],
            _pages(v_cache, pages[None, :n])[0, :total])
