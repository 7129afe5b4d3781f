"""bf16 / fp16 paged KV (the fast path's cache): attention reads the stored values exactly as fp32.

Oracles: the float64 attention of tests/ops/test_attention_rows.py over the values the cache
actually holds (the kernel must match it as tightly as with an fp32 cache), and the same op on
an fp32 cache (the only difference then is the storage rounding: bf16 keeps 8 significant bits,
fp16 11, so outputs move by about 2^-8 / 2^-11 of |v|). A verify step's rows still equal 1-row
decode rows bit for bit with a low-precision cache.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.ops import attention_rows as ar
from specdeploy.ops import cached_attention as ca
from tests.ops.test_attention_rows import _cache, _oracle

# dtype, tolerance vs the fp32 cache relative to max |output| (measured: ~2^-8, ~2^-11.4)
LOW = [(torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)]


@pytest.mark.skipif(ar.unavailable() is not None, reason=f"kernel: {ar.unavailable()}")
@pytest.mark.parametrize("dtype,tol", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("pos0,t", [(0, 1), (5, 4), (90, 6)])
def test_kernel_on_low_precision_cache_matches_the_oracle(dtype, tol, pos0, t):
    kc, vc, pages = _cache()
    q = torch.randn(t, 9, 64, generator=torch.Generator().manual_seed(t)) * 2
    assert ar.fits(q, kc.to(dtype), vc.to(dtype))
    with ar.bf16_dots(False):  # the stored values read exactly as fp32
        got = ar.attention_rows(q, kc.to(dtype), vc.to(dtype), pages, pos0, 0.125)
    held = _oracle(q, kc.to(dtype).float(), vc.to(dtype).float(), pages, pos0, 0.125)
    torch.testing.assert_close(got.double(), held, rtol=0, atol=1e-5 * vc.abs().max().item())
    full = ar.attention_rows(q, kc, vc, pages, pos0, 0.125)
    torch.testing.assert_close(got, full, rtol=0, atol=tol * vc.abs().max().item())


def _run(dtype, segs_list, kernel=True):
    """cached_attention_impl over a fresh cache of `dtype`: a 20-token prefill of 2 sequences,
    then the steps in `segs_list` ((seq, start, length) per segment); outputs per step."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 9, 3, 64, 4
    q, k, v = (torch.randn(2, 30, h, d, generator=g) for h in (hq, hkv, hkv))
    kc = torch.zeros(16, ps, hkv, d, dtype=dtype)
    vc = torch.zeros(16, ps, hkv, d, dtype=dtype)
    pages = [list(range(0, 16, 2)), list(range(1, 16, 2))]
    outs = []
    for segs in [[(0, 0, 20), (1, 0, 20)], *segs_list]:
        meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                               for s, st, ln in segs])
        qq, kk, vv = (torch.cat([x[s, st:st + ln] for s, st, ln in segs])[None]
                      for x in (q, k, v))
        outs.append(ca.cached_attention_impl(
            qq, kk, vv, kc, vc, meta.cu_seqlens, meta.cu_seqlens, meta.cache_lens,
            meta.cache_lens, meta.page_table, d ** -0.5, 0)[0])
    return outs


@pytest.mark.parametrize("dtype,tol", LOW, ids=["bf16", "fp16"])
def test_cached_attention_on_low_precision_cache_is_near_fp32(dtype, tol):
    """Prefill (20 rows: the SDPA path), a 5-row verify and a decode row per sequence, each
    against the same steps on an fp32 cache."""
    steps = [[(0, 20, 5), (1, 20, 1)], [(0, 25, 1), (1, 21, 4)]]
    want, got = _run(torch.float32, steps), _run(dtype, steps)
    for w, o in zip(want, got):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, w, rtol=0, atol=tol * w.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_verify_rows_equal_decode_rows_on_low_precision_cache(dtype):
    decode = _run(dtype, [[(0, 20 + i, 1)] for i in range(5)])[1:]
    verify = _run(dtype, [[(0, 20, 5)]])[1]
    assert torch.equal(torch.cat(decode), verify)


bf16_dots_here = pytest.mark.skipif(
    ar.unavailable() is not None or not ar.bf16_dots_supported(),
    reason="this CPU has no AVX512-BF16 (or no attention kernel): bf16 caches read as fp32")


@bf16_dots_here
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 96)])
@pytest.mark.parametrize("pos0,t", [(0, 1), (5, 4), (31, 2), (90, 6)])
def test_bf16_dot_products_match_the_oracle_of_the_rounded_query(hq, hkv, d, pos0, t):
    """AVX512-BF16 dot products on a bf16 cache: the query is rounded to bf16 (so the oracle
    takes the rounded query: the scores then agree to fp32 round-off), and the softmax weights
    are rounded to bf16 before they weigh the values (8 significant bits: each output moves by
    at most ~2^-9 of max |v| from that; 2^-8 stated). Odd key counts (pos0 + t odd) take the
    last key pair half masked."""
    kc, vc, pages = _cache(hkv=hkv, d=d, dv=d)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(t + d)) * 2
    got = ar.attention_rows(q, kb, vb, pages, pos0, d ** -0.5)
    held = _oracle(q.bfloat16().float(), kb.float(), vb.float(), pages, pos0, d ** -0.5)
    torch.testing.assert_close(got.double(), held, rtol=0, atol=2 ** -8 * vc.abs().max().item())
    with ar.bf16_dots(False):
        exact = ar.attention_rows(q, kb, vb, pages, pos0, d ** -0.5)
    if pos0 + t > 1:  # (one key: a weight of exactly 1 on both paths)
        assert not torch.equal(got, exact)  # the bf16 path did run
    # rows are batch invariant on this path too: each alone equals it inside the segment
    for i in range(t):
        one = ar.attention_rows(q[i:i + 1], kb, vb, pages, pos0 + i, d ** -0.5)
        assert torch.equal(one, got[i:i + 1])


@bf16_dots_here
def test_bf16_dot_products_never_read_a_later_key():
    """A decode row at position p with an odd key count shares its last key pair with key p + 1
    (written later, or stale): a NaN there must not reach the row (a weight of 0 times NaN)."""
    kc, vc, pages = _cache()
    kb, vb = kc.bfloat16(), vc.bfloat16()
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(9))
    pos = 36  # 37 keys: chunk 1 holds keys 32..36, an odd count
    want = ar.attention_rows(q, kb, vb, pages, pos, 0.125)
    page, off = divmod(pos + 1, kb.shape[1])
    kb[pages[page], off], vb[pages[page], off] = float("nan"), float("nan")
    got = ar.attention_rows(q, kb, vb, pages, pos, 0.125)
    assert torch.isfinite(got).all() and torch.equal(got, want)
