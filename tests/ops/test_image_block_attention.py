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
