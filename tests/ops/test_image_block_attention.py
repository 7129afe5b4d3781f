"""`cached_attention` with bidirectional blocks (`key_extent_host`: Gemma 3's image tokens see
their whole image) against `attention_ref(..., key_extent=)` over the whole sequence."""
from __future__ import annotations

import pytest
import torch

import specdeploy.ops.cached_attention  # noqa: F401  (registers the op)
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.ops import attention_ref


@pytest.mark.parametrize("window,dv,page", [(0, 8, 4), (4, 8, 16), (4, 6, 4), (0, 6, 16)])
def test_cached_attention_with_image_blocks_equals_ref(window, dv, page):
    """The cached op, fed like the engine (chunks ending outside the blocks, two sequences in
    one step, pages out of order), = `attention_ref` with the same key extents over the whole
    sequence; window 4 < the second block's 7 tokens, so the window bounds the block's rows.
    dv 6 != d 8 takes the torch paths, dv 8 the C rows."""
    gen = torch.Generator().manual_seed(window + dv)
    n, hq, hkv, d = 23, 4, 2, 8
    ext = torch.zeros(n, dtype=torch.long)
    ext[5:9], ext[14:21] = 9, 21
    seqs = [tuple(torch.randn(1, n, h, w, generator=gen) for h, w in ((hq, d), (hkv, d),
                                                                      (hkv, dv)))
            for _ in range(2)]
    k_cache = 1e3 * torch.randn(32, page, hkv, d, generator=gen)
    v_cache = 1e3 * torch.randn(32, page, hkv, dv, generator=gen)
    pages = [list(range(31, 31 - 8, -1)), list(range(0, 16, 2))]
    cuts = [[0, 3, 9, 14, 23], [0, 5, 12, 23]]
    got = [[], []]
    for step in range(4):
        segs = []
        for s in range(2):
            if step + 1 >= len(cuts[s]):
                continue
            a, b = cuts[s][step], cuts[s][step + 1]
            segs.append((s, a, b))
        meta = build_metadata([Segment([0] * (b - a), a, pages[s], s) for s, a, b in segs])
        xs = [torch.cat([seqs[s][i][:, a:b] for s, a, b in segs], 1) for i in range(3)]
        extent = torch.cat([ext[a:b] for _, a, b in segs])
        out = torch.ops.specdeploy.cached_attention(
            *xs, k_cache, v_cache, meta.cu_seqlens, meta.cu_seqlens, meta.cache_lens,
            meta.cache_lens, meta.page_table, d ** -0.5, window,
            key_extent_host=extent)
        for (s, _, _), (lo, hi) in zip(segs, zip(meta.cu_seqlens[:-1], meta.cu_seqlens[1:])):
            got[s].append(out[:, lo:hi])
    for s in range(2):
        want = attention_ref(*seqs[s], d ** -0.5, window, key_extent=ext)
        assert (torch.cat(got[s], 1) - want).abs().max() <= 1e-5 * want.abs().max()
        causal = attention_ref(*seqs[s], d ** -0.5, window)
        assert (causal - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dv", [8, 6])
def test_image_blocks_over_a_low_precision_cache(dtype, dv):
    """An FP8 / bf16 cache (kv_cache_dtype) under image blocks: the widened rows read the
    rounded keys and values like every other row, so the result = `attention_ref` over K / V
    rounded to the cache dtype (exact math), for the C rows (dv 8) and the torch paths (dv 6).
    The unrounded reference is farther off than the tolerance (the check can see the cast)."""
    gen = torch.Generator().manual_seed(7 + dv)
    n, hq, hkv, d, page = 17, 4, 2, 8, 4
    ext = torch.zeros(n, dtype=torch.long)
    ext[3:8] = 8
    q, k, v = (torch.randn(1, n, h, w, generator=gen) for h, w in ((hq, d), (hkv, d),
                                                                   (hkv, dv)))
    k_cache = torch.full((8, page, hkv, d), float("nan")).to(dtype)
    v_cache = torch.full((8, page, hkv, dv), float("nan")).to(dtype)
    pages = [6, 1, 4, 0, 7]
    outs = []
    for a, b in ((0, 2), (2, 11), (11, 12), (12, 17)):  # the block's rows in one chunk
        meta = build_metadata([Segment([0] * (b - a), a, pages, 0)])
        outs.append(torch.ops.specdeploy.cached_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], k_cache, v_cache, meta.cu_seqlens,
            meta.cu_seqlens, meta.cache_lens, meta.cache_lens, meta.page_table, d ** -0.5, 0,
            key_extent_host=ext[a:b]))
    got = torch.cat(outs, 1)
    want = attention_ref(q, k.to(dtype).float(), v.to(dtype).float(), d ** -0.5, 0,
                         key_extent=ext)
    tol = 1e-5 * want.abs().max()
    assert (got - want).abs().max() <= tol
    assert (attention_ref(q, k, v, d ** -0.5, 0, key_extent=ext) - want).abs().max() > 10 * tol
