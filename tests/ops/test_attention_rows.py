"""The batch-invariant attention kernel for short segments (ops/attention_rows.c) against a
float64 softmax attention written here (the oracle), and the invariance it exists for: a row's
output is bit-identical alone or among 16 rows, at 1 or 2 threads, and through
`cached_attention` a verify step's rows equal the 1-row decode steps' rows bit for bit (with the
kernel, and with the per-row SDPA fallback where the kernel does not fit)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.ops import attention_rows as ar
from specdeploy.ops import cached_attention as ca

needs_kernel = pytest.mark.skipif(ar.unavailable() is not None,
                                  reason=f"attention kernel unavailable: {ar.unavailable()}")


def _cache(pages=12, page_size=8, hkv=3, d=64, dv=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page_size, hkv, d, generator=g),
            torch.randn(pages, page_size, hkv, dv, generator=g),
            torch.randperm(pages, generator=g))


def _oracle(q, kc, vc, pages, pos0, scale, window=0, sinks=None):
    """float64: row t attends keys 0..pos0 + t of the sequence's pages (only those past
    pos0 + t - window where window > 0); sinks [Hq]: one more logit per head in each softmax,
    weighing no value (gpt-oss's)."""
    hkv = kc.shape[2]
    keys = kc[pages].reshape(-1, hkv, kc.shape[-1]).double()
    vals = vc[pages].reshape(-1, hkv, vc.shape[-1]).double()
    rep = q.shape[1] // hkv
    out = []
    for t in range(q.shape[0]):
        n = pos0 + t + 1
        a = max(0, n - window) if window > 0 else 0
        k = keys[a:n].repeat_interleave(rep, 1)  # [n - a, Hq, D]
        v = vals[a:n].repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), k).mul(scale)
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), 1)
        w = s.softmax(-1)[:, :n - a]
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 8)])
@pytest.mark.parametrize("pos0,t", [(0, 1), (0, 16), (5, 4), (37, 7), (90, 6)])
def test_matches_the_float64_oracle(hq, hkv, d, pos0, t):
    kc, vc, pages = _cache(hkv=hkv, d=d, dv=d)
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(t)) * 2
    got = ar.attention_rows(q, kc, vc, pages, pos0, d ** -0.5)
    # fp32 dot products, a polynomial exp (< 2e-7 relative), sums over <= 96 keys in chunks
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, pages, pos0, d ** -0.5),
                               rtol=0, atol=1e-5 * vc.abs().max().item())


@needs_kernel
def test_rows_are_batch_and_thread_invariant():
    kc, vc, pages = _cache()
    q = torch.randn(16, 9, 64, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = ar.attention_rows(q, kc, vc, pages, 60, 0.125)
            alone = [ar.attention_rows(q[i:i + 1], kc, vc, pages, 60 + i, 0.125)
                     for i in range(16)]
            assert torch.equal(torch.cat(alone), full)
            assert torch.equal(ar.attention_rows(q[3:7], kc, vc, pages, 63, 0.125), full[3:7])
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_long_segments_across_key_chunks_and_row_windows():
    """150 rows at positions 100..249 (keys in chunks of 32, rows in passes of 64): each row
    matches the float64 oracle and is bit-identical to itself computed alone, at 1 and 2
    threads (rows 63/64 and 127/128 straddle passes; 127/128 sit on a chunk boundary)."""
    kc, vc, pages = _cache(pages=40, page_size=8, seed=4)
    q = torch.randn(150, 9, 64, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = ar.attention_rows(q, kc, vc, pages, 100, 0.125)
            for i in (0, 31, 63, 64, 127, 128, 149):
                assert torch.equal(ar.attention_rows(q[i:i + 1], kc, vc, pages, 100 + i, 0.125),
                                   full[i:i + 1])
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)
    # fp32 dot products, a polynomial exp and partial softmaxes over <= 8 chunks of 32 keys
    torch.testing.assert_close(outs[0].double(), _oracle(q, kc, vc, pages, 100, 0.125),
                               rtol=0, atol=1e-5 * vc.abs().max().item())


@needs_kernel
def test_refuses_positions_past_the_pages_and_what_it_cannot_take():
    kc, vc, pages = _cache(pages=2, page_size=8)
    with pytest.raises(ValueError, match="outside the sequence's 2 pages"):
        ar.attention_rows(torch.randn(2, 9, 64), kc, vc, pages, 15, 0.125)
    assert ar.fits(torch.randn(1, 9, 64), kc, vc)
    assert not ar.fits(torch.randn(1, 9, 64).bfloat16(), kc.bfloat16(), vc.bfloat16())
    assert not ar.fits(torch.randn(1, 9, 12), *_cache(hkv=3, d=12, dv=12)[:2])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa-fallback"])
def test_verify_rows_equal_decode_rows_through_cached_attention(kernel, monkeypatch):
    """Two sequences: 1-row decode steps one position at a time vs the same positions as one
    verify segment each (and both sequences in one step): bit-identical outputs."""
    if kernel and ar.unavailable() is not None:
        pytest.skip(f"attention kernel unavailable: {ar.unavailable()}")
    if not kernel:
        monkeypatch.setattr(ar, "fits", lambda *a: False)
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, ps = 9, 3, 64, 4
    prefix, n = 10, 5
    q = torch.randn(2, prefix + n, hq, d, generator=g)
    k = torch.randn(2, prefix + n, hkv, d, generator=g)
    v = torch.randn(2, prefix + n, hkv, d, generator=g)
    pages = [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    def step(segs):  # segs: (seq, start, length)
        kc, vc = caches
        meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                               for s, st, ln in segs])
        qq = torch.cat([q[s, st:st + ln] for s, st, ln in segs])[None]
        kk = torch.cat([k[s, st:st + ln] for s, st, ln in segs])[None]
        vv = torch.cat([v[s, st:st + ln] for s, st, ln in segs])[None]
        return ca.cached_attention_impl(qq, kk, vv, kc, vc, meta.cu_seqlens, meta.cu_seqlens,
                                        meta.cache_lens, meta.cache_lens, meta.page_table,
                                        d ** -0.5, 0)[0]

    caches = (torch.zeros(10, ps, hkv, d), torch.zeros(10, ps, hkv, d))
    step([(0, 0, prefix), (1, 0, prefix)])
    decode = [step([(0, prefix + i, 1), (1, prefix + i, 1)]) for i in range(n)]
    caches = (torch.zeros(10, ps, hkv, d), torch.zeros(10, ps, hkv, d))
    step([(0, 0, prefix), (1, 0, prefix)])
    verify = step([(0, prefix, n), (1, prefix, n)])
    assert torch.equal(torch.stack([x[0] for x in decode]), verify[:n])
    assert torch.equal(torch.stack([x[1] for x in decode]), verify[n:])


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 32, 40, 70, 500])
@pytest.mark.parametrize("pos0,t", [(0, 16), (37, 7), (90, 6), (31, 3)])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_sliding_windows_and_sinks_match_the_float64_oracle(window, pos0, t, with_sinks):
    """Windows inside one 32-key chunk, across chunk edges and wider than the sequence, with
    and without sinks (some sinks far above the scores: most of the mass goes to them)."""
    kc, vc, pages = _cache(hkv=3, d=64, dv=64)
    g = torch.Generator().manual_seed(7 * t + window)
    q = torch.randn(t, 9, 64, generator=g) * 2
    sinks = torch.randn(9, generator=g) * 3 if with_sinks else None
    got = ar.attention_rows(q, kc, vc, pages, pos0, 0.125, window=window, sinks=sinks)
    want = _oracle(q, kc, vc, pages, pos0, 0.125, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * vc.abs().max().item())
    if window < pos0 or with_sinks:  # the guard: the window / the sinks change the output
        full = _oracle(q, kc, vc, pages, pos0, 0.125)
        assert (full - want).abs().max() > 1e-2 * vc.abs().max()


@needs_kernel
def test_windowed_rows_are_batch_and_thread_invariant():
    kc, vc, pages = _cache(pages=24, page_size=8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(16, 9, 64, generator=g)
    sinks = torch.randn(9, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = ar.attention_rows(q, kc, vc, pages, 100, 0.125, window=45, sinks=sinks)
            alone = [ar.attention_rows(q[i:i + 1], kc, vc, pages, 100 + i, 0.125, window=45,
                                       sinks=sinks) for i in range(16)]
            assert torch.equal(torch.cat(alone), full)
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_sinks_of_the_wrong_shape_are_refused():
    kc, vc, pages = _cache()
    with pytest.raises(ValueError, match=r"one per query head \(9\), got shape \(3,\)"):
        ar.attention_rows(torch.randn(1, 9, 64), kc, vc, pages, 3, 0.125, sinks=torch.ones(3))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa-fallback"])
@pytest.mark.parametrize("one_call", [True, False], ids=["write-attend", "separate"])
def test_windowed_verify_rows_equal_decode_rows_and_the_oracle(kernel, one_call, monkeypatch):
    """A window of 6 over a 10-token prefix: 1-row decode steps, one 5-row verify segment per
    sequence (with the cache writes in the same C call or not), bit-identical, and equal to the
    float64 oracle within fp32 rounding."""
    if kernel and ar.unavailable() is not None:
        pytest.skip(f"attention kernel unavailable: {ar.unavailable()}")
    if not kernel:
        monkeypatch.setattr(ar, "fits", lambda *a: False)
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, ps, window = 4, 2, 32, 4, 6
    prefix, n = 10, 5
    q = torch.randn(2, prefix + n, hq, d, generator=g)
    k = torch.randn(2, prefix + n, hkv, d, generator=g)
    v = torch.randn(2, prefix + n, hkv, d, generator=g)
    pages = [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    def step(segs):
        kc, vc = caches
        meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                               for s, st, ln in segs])
        slots = torch.cat([torch.tensor([pages[s][p // ps] * ps + p % ps
                                         for p in range(st, st + ln)]) for s, st, ln in segs])
        qq = torch.cat([q[s, st:st + ln] for s, st, ln in segs])[None]
        kk = torch.cat([k[s, st:st + ln] for s, st, ln in segs])[None]
        vv = torch.cat([v[s, st:st + ln] for s, st, ln in segs])[None]
        return ca.cached_attention_impl(qq, kk, vv, kc, vc, meta.cu_seqlens, meta.cu_seqlens,
                                        meta.cache_lens, meta.cache_lens, meta.page_table,
                                        d ** -0.5, window, slots if one_call else None)[0]

    caches = (torch.zeros(10, ps, hkv, d), torch.zeros(10, ps, hkv, d))
    step([(0, 0, prefix), (1, 0, prefix)])
    decode = [step([(0, prefix + i, 1), (1, prefix + i, 1)]) for i in range(n)]
    caches = (torch.zeros(10, ps, hkv, d), torch.zeros(10, ps, hkv, d))
    step([(0, 0, prefix), (1, 0, prefix)])
    verify = step([(0, prefix, n), (1, prefix, n)])
    assert torch.equal(torch.stack([x[0] for x in decode]), verify[:n])
    assert torch.equal(torch.stack([x[1] for x in decode]), verify[n:])
    kc, vc = caches
    for s in (0, 1):
        want = _oracle(q[s, prefix:], kc, vc, torch.tensor(pages[s]), prefix, d ** -0.5, window)
        torch.testing.assert_close(verify[s * n:(s + 1) * n].double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa-fallback"])
@pytest.mark.parametrize("one_call", [True, False], ids=["write-attend", "separate"])
@pytest.mark.parametrize("hkv,dtype", [(1, torch.float32), (2, torch.float32),
                                       (1, torch.bfloat16)], ids=["mla", "2kv", "bf16"])
def test_value_in_key_equals_a_separate_value_cache(kernel, one_call, hkv, dtype, monkeypatch):
    """MLA's cache (cache/handlers.py PagedKV.value_in_key): the value cache a view of the key
    cache's leading dims, values never written on their own. Prefill, 1-row decodes and a
    verify segment give the bits of the same keys with their values in a cache of their own,
    and the keys' cache is the same."""
    if kernel and ar.unavailable() is not None:
        pytest.skip(f"attention kernel unavailable: {ar.unavailable()}")
    if not kernel:
        monkeypatch.setattr(ar, "fits", lambda *a: False)
    g = torch.Generator().manual_seed(6)
    hq, d, dv, ps = 4, 40, 32, 4
    prefix, n = 10, 5
    q = torch.randn(2, prefix + n, hq, d, generator=g)
    k = torch.randn(2, prefix + n, hkv, d, generator=g)
    pages = [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    def run(shared: bool):
        kc = torch.zeros(10, ps, hkv, d, dtype=dtype)
        vc = kc[..., :dv] if shared else torch.zeros(10, ps, hkv, dv, dtype=dtype)

        def step(segs):
            meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                                   for s, st, ln in segs])
            slots = torch.cat([torch.tensor([pages[s][p // ps] * ps + p % ps
                                             for p in range(st, st + ln)])
                               for s, st, ln in segs])
            qq = torch.cat([q[s, st:st + ln] for s, st, ln in segs])[None]
            kk = torch.cat([k[s, st:st + ln] for s, st, ln in segs])[None]
            return ca.cached_attention_impl(qq, kk, kk[..., :dv], kc, vc, meta.cu_seqlens,
                                            meta.cu_seqlens, meta.cache_lens, meta.cache_lens,
                                            meta.page_table, d ** -0.5, 0,
                                            slots if one_call else None)[0]

        outs = [step([(0, 0, prefix), (1, 0, prefix)])]
        outs += [step([(0, prefix + i, 1), (1, prefix + i, 1)]) for i in range(2)]
        outs.append(step([(0, prefix + 2, n - 2), (1, prefix + 2, n - 2)]))
        return outs, kc

    (want, kc_want), (got, kc_got) = run(False), run(True)
    assert torch.equal(kc_got, kc_want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    kv = kc_want.float()
    for s in (0, 1):  # and the rows are right: the float64 oracle over what the cache holds
        oracle = _oracle(q[s, prefix + 2:], kv, kv[..., :dv], torch.tensor(pages[s]),
                         prefix + 2, d ** -0.5)
        torch.testing.assert_close(got[3][s * (n - 2):(s + 1) * (n - 2)].double(), oracle,
                                   rtol=0, atol=1e-2 if dtype is torch.bfloat16 else 1e-5)


def test_value_in_key_on_the_batched_paths():
    """The batched decode / uniform verify (off the CPU's paths) read a value cache that is the
    key cache's leading dims as they read a copy of it: the same bits."""
    g = torch.Generator().manual_seed(8)
    kc = torch.randn(10, 4, 1, 40, generator=g)
    pt, lens = torch.tensor([[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]), torch.tensor([12, 7])
    q, qv = torch.randn(2, 4, 40, generator=g), torch.randn(1, 6, 4, 40, generator=g)
    shared, copy = kc[..., :32], kc[..., :32].contiguous()
    assert torch.equal(ca._decode(q, kc, shared, pt, lens, 0.2, 0),
                       ca._decode(q, kc, copy, pt, lens, 0.2, 0))
    assert torch.equal(ca.extend_uniform(qv, kc, shared, pt, lens, 0.2, 0),
                       ca.extend_uniform(qv, kc, copy, pt, lens, 0.2, 0))


@needs_kernel
def test_cached_attention_with_sinks_takes_the_kernel(monkeypatch):
    """Sinks where the kernel fits: `cached_attention` never reaches the torch sink paths
    (ops/sink_attention.py), in a prefill, decode steps and a verify step; each row matches the
    float64 oracle with sinks and a window."""
    from specdeploy.ops import sink_attention

    def torch_path(*a):
        raise AssertionError("the torch sink path ran")

    monkeypatch.setattr(sink_attention, "cached_attention_sinks", torch_path)
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, ps, window, n = 4, 2, 32, 4, 7, 14
    q, k, v = (torch.randn(1, n, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g) * 2
    kc, vc = torch.zeros(4, ps, hkv, d), torch.zeros(4, ps, hkv, d)
    pages = [2, 0, 3, 1]
    outs = []
    for start, ln in [(0, 9), (9, 1), (10, 4)]:
        meta = build_metadata([Segment([0] * ln, start, pages, 0, ln, SEG_EXTEND)])
        outs.append(torch.ops.specdeploy.cached_attention(
            q[:, start:start + ln], k[:, start:start + ln], v[:, start:start + ln], kc, vc,
            meta.cu_seqlens, meta.cu_seqlens, meta.cache_lens, meta.cache_lens, meta.page_table,
            d ** -0.5, window, sinks=sinks)[0])
    want = _oracle(q[0], kc, vc, torch.tensor(pages), 0, d ** -0.5, window, sinks)
    torch.testing.assert_close(torch.cat(outs).double(), want, rtol=0, atol=1e-5)
