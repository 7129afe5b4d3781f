"""Decode attention reads exactly a sequence's pages, whatever their order (regression: pages
[3, 7, 5] look consecutive from their ends)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import Segment, build_metadata, kv_slot_mapping
from specdeploy.ops import attention_ref
from specdeploy.ops.cached_attention import cached_attention_impl

PS = 4


def _call(q, k, v, kc, vc, meta, slot_mapping):
    return cached_attention_impl(q, k, v, kc, vc, meta.cu_seqlens, meta.cu_seqlens, meta.cache_lens,
                                 meta.cache_lens, meta.page_table, 0.25, 0, slot_mapping)


@pytest.mark.parametrize("pages", [[3, 7, 5], [0, 1, 2], [6, 2, 4], [2, 3, 9]])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_matches_ref_for_any_page_order(pages, batch):
    torch.manual_seed(0)
    n, hq, hkv, d = 11, 4, 2, 16
    q, k, v = torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
    kc, vc = torch.randn(12, PS, hkv, d), torch.randn(12, PS, hkv, d)  # garbage elsewhere
    other = [p for p in range(12) if p not in pages][:3]
    segs = [Segment(list(range(n - 1)), 0, pages, 0)] + (
        [Segment(list(range(n - 1)), 0, other, 1)] if batch == 2 else [])
    meta = build_metadata(segs)
    rep = batch
    _call(q[:, :-1].repeat(1, rep, 1, 1), k[:, :-1].repeat(1, rep, 1, 1),
          v[:, :-1].repeat(1, rep, 1, 1), kc, vc, meta, kv_slot_mapping(meta, PS))
    segs = [Segment([0], n - 1, pages, 0)] + ([Segment([0], n - 1, other, 1)] if batch == 2 else [])
    meta = build_metadata(segs)
    out = _call(q[:, -1:].repeat(1, rep, 1, 1), k[:, -1:].repeat(1, rep, 1, 1),
                v[:, -1:].repeat(1, rep, 1, 1), kc, vc, meta, kv_slot_mapping(meta, PS))
    want = attention_ref(q, k, v, 0.25)[:, -1]
    for i in range(batch):
        torch.testing.assert_close(out[0, i], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pages", [[3, 7, 5], [0, 1, 2], [6, 2, 4], [2, 3, 9]])
@pytest.mark.parametrize("tail", [2, 4, 7])
def test_extend_matches_ref_for_any_page_order(pages, tail):
    """A chunk of `tail` queries after n - tail cached positions (a verify segment or a prefill
    chunk): consecutive pages are read through a view, others gathered; both equal the ref."""
    torch.manual_seed(1)
    n, hq, hkv, d = 11, 4, 2, 16
    q, k, v = torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
    kc, vc = torch.randn(12, PS, hkv, d), torch.randn(12, PS, hkv, d)  # garbage elsewhere
    head = n - tail
    meta = build_metadata([Segment(list(range(head)), 0, pages, 0)])
    _call(q[:, :head], k[:, :head], v[:, :head], kc, vc, meta, kv_slot_mapping(meta, PS))
    meta = build_metadata([Segment(list(range(tail)), head, pages, 0, tail)])
    out = _call(q[:, head:], k[:, head:], v[:, head:], kc, vc, meta, kv_slot_mapping(meta, PS))
    want = attention_ref(q, k, v, 0.25)[:, head:]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_short_segment_masks_are_built_once():
    """Verify segments reuse one mask per (length, total, window) across layers and steps; it is
    the mask attention_mask builds, and one built in inference mode still serves autograd."""
    from specdeploy.ops.attention import attention_mask
    from specdeploy.ops.cached_attention import _short_mask

    _short_mask.cache_clear()
    with torch.inference_mode():
        first = _short_mask(4, 37, 0)
    assert not first.is_inference()
    assert _short_mask(4, 37, 0) is first
    assert torch.equal(first, attention_mask(4, 37))
    windowed = _short_mask(4, 37, 5)
    assert torch.equal(windowed, attention_mask(4, 37, 5)) and not torch.equal(windowed, first)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("n", [1, 4])
def test_uniform_extend_matches_the_per_segment_path(n, window):
    """`extend_uniform` (the GPU's verify path, static shapes for CUDA graphs) run on the CPU:
    3 segments of n queries after different cached lengths, pages in any order, a page table
    wider than any needs, against the ref over each sequence's whole history."""
    from specdeploy.ops.cached_attention import extend_uniform

    torch.manual_seed(2)
    hq, hkv, d, lens = 4, 2, 16, [3, 9, 6]
    tables = [[3, 7, 5, 0], [1, 8, 10, 11], [2, 4, 9, 6]]
    kc, vc = torch.randn(12, PS, hkv, d), torch.randn(12, PS, hkv, d)
    seqs = [(torch.randn(1, m + n, hq, d), torch.randn(1, m + n, hkv, d),
             torch.randn(1, m + n, hkv, d)) for m in lens]
    for (q, k, v), m, pages in zip(seqs, lens, tables):  # the history of each sequence
        meta = build_metadata([Segment(list(range(m)), 0, pages, 0)])
        _call(q[:, :m], k[:, :m], v[:, :m], kc, vc, meta, kv_slot_mapping(meta, PS))
    meta = build_metadata([Segment([0] * n, m, pages, i, n)
                           for i, (m, pages) in enumerate(zip(lens, tables))])
    cat = [torch.cat([s[j][:, m:] for s, m in zip(seqs, lens)], 1) for j in range(3)]
    from specdeploy.ops.cached_attention import _write_kv

    _write_kv(cat[1], cat[2], kc, vc, meta.cu_seqlens, meta.cache_lens, meta.page_table,
              kv_slot_mapping(meta, PS))
    out = extend_uniform(cat[0], kc, vc, meta.page_table, meta.cache_lens, 0.25, window)
    for i, ((q, k, v), m) in enumerate(zip(seqs, lens)):
        mask = None
        if window:
            pos = torch.arange(m + n)
            mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - window)
        want = _sdpa_ref(q, k, v, 0.25, mask)[:, m:]
        torch.testing.assert_close(out[:, i * n:(i + 1) * n], want, rtol=1e-5, atol=1e-5)


def _sdpa_ref(q, k, v, scale, mask):
    if mask is None:
        return attention_ref(q, k, v, scale)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
