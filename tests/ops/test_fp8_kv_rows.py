"""FP8 paged KV caches on the CPU's C attention (ops/attention_rows.c): float8_e4m3fn (KV_F8:
`kv_cache_dtype="fp8"`, vLLM's name, or a checkpoint that declares an FP8 KV cache) and
float8_e5m2 (KV_F8E5: `kv_cache_dtype="fp8_e5m2"`).

Oracles: torch's own `.to(torch.float8_e4m3fn)` / `.float()` for the bits the kernel writes and
reads (every byte, ties, subnormals, saturation, NaN), the float64 attention of
tests/ops/test_attention_rows.py over the values the cache holds (as tight as with an fp32
cache: the kernel widens exactly), the torch cache writes of `cached_attention` (the same bytes
and outputs as the kernel's one-call writes), and the generic C kernels of the wide path (bit
for bit the AVX2 ones)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.ops import attention_rows as ar
from specdeploy.ops import cached_attention as ca
from tests.ops.test_attention_rows import _cache, _oracle

BOTH = pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2],
                               ids=["e4m3", "e5m2"])
pytestmark = pytest.mark.skipif(ar.unavailable() is not None,
                                reason=f"attention kernel unavailable: {ar.unavailable()}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _edge_values(f8: torch.dtype) -> torch.Tensor:
    """fp32 values around every code of `f8` (the codes, the midpoints between neighbours, one
    ulp either side of each midpoint), past its range, and the special values."""
    codes = torch.arange(256, dtype=torch.uint8).view(f8).float()
    pos = codes[:0x7F][codes[:0x7F].isfinite()]  # 0 .. the largest finite, in order
    mid = (pos[1:] + pos[:-1]) / 2  # exact in fp32: the ties
    near = torch.cat([mid.nextafter(torch.full_like(mid, -1)), mid,
                      mid.nextafter(torch.full_like(mid, 1e9))])
    big = torch.tensor([448.0, 455.9, 456.0, 460.0, 463.99, 464.0, 464.01, 479.9, 480.0, 1e6,
                        3e38, float("inf"), 2.0 ** -10, 2.0 ** -9.5, 1e-30, 1e-45, 0.0,
                        float("nan"), 57344.0, 61439.99, 61440.0, 65536.0, 2.0 ** -17,
                        3 * 2.0 ** -18])
    x = torch.cat([pos, near, big])
    return torch.cat([x, -x])


@BOTH
def test_kernel_writes_the_bytes_torch_casts_to(f8):
    """Keys and values written by the one-call kernel (`write_attend_rows`, the fused layers'
    and CPU graphs' path), on the AVX2 and the generic C stores, = torch's cast, byte for byte:
    E4M3 to nearest even saturating at +-448 (infinities too), E5M2 to nearest even overflowing
    to infinity, NaN to NaN."""
    vals = _edge_values(f8)
    n = -(-vals.numel() // 64) * 64
    x = torch.cat([vals, torch.zeros(n - vals.numel())]).view(-1, 2, 32)  # [T, Hkv=2, D=32]
    t = x.shape[0]
    want = x.to(f8).view(torch.uint8)
    for scalar in (False, True):
        kc = torch.zeros(t, 1, 2, 32, dtype=f8)
        vc = torch.zeros(t, 1, 2, 32, dtype=f8)
        qk = torch.cat([torch.zeros(t, 2, 32), x], 1).contiguous()  # 2 query heads, then keys
        qkv = x.reshape(1, t, 64).contiguous()
        meta = build_metadata([Segment([0] * t, 0, list(range(t)), 0, t, SEG_EXTEND)])
        slots = torch.arange(t)
        with ar.wide_mode(every=scalar, scalar=scalar):
            ar.write_attend_rows(qk, qkv, 0, kc, vc, slots, meta.cu_seqlens, meta.cache_lens,
                                 meta.page_table, 0.1)
        got_k, got_v = kc.view(torch.uint8)[:, 0], vc.view(torch.uint8)[:, 0]
        bad = (got_k != want).nonzero()
        assert bad.numel() == 0, f"scalar={scalar}: {x[tuple(bad[0])]} -> {got_k[tuple(bad[0])]}"
        assert torch.equal(got_v, want)


@BOTH
@pytest.mark.parametrize("wide,scalar", [(False, False), (True, False), (True, True)],
                         ids=["chunked", "wide-avx2", "wide-scalar"])
def test_every_byte_widens_exactly(wide, scalar, f8):
    """One key: its weight is exactly 1, so the output is the value row as the kernel widened
    it: every one of the 256 codes = torch's `.float()` (NaN codes NaN, E5M2's infinities
    infinite), on the AVX2 loads and on the wide path's generic C ones."""
    vc = torch.zeros(1, 8, 1, 256, dtype=f8)
    vc[0, 0, 0] = torch.arange(256, dtype=torch.uint8).view(f8)
    kc = torch.zeros(1, 8, 1, 8, dtype=f8)
    q = torch.randn(1, 1, 8)
    with ar.wide_mode(every=wide, scalar=scalar):
        out = ar.attention_rows(q, kc, vc, torch.zeros(1, dtype=torch.long), 0, 1.0)
    assert _same(out[0, 0], vc[0, 0, 0].float())


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 8)])
@pytest.mark.parametrize("pos0,t,window", [(0, 1, 0), (5, 4, 0), (90, 6, 0), (37, 7, 5),
                                           (90, 6, 40)])
@BOTH
def test_fp8_cache_matches_the_oracle_over_what_it_holds(hq, hkv, d, pos0, t, window, f8):
    """The kernel on an FP8 cache = the float64 attention over the cache's values within the
    fp32 cache's tolerance (1e-5 of max |v|); the unrounded values are farther off than
    that (the test sees the rounding)."""
    kc, vc, pages = _cache(hkv=hkv, d=d, dv=d)
    k8, v8 = kc.to(f8), vc.to(f8)
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(t)) * 2
    assert ar.fits(q, k8, v8)
    got = ar.attention_rows(q, k8, v8, pages, pos0, d ** -0.5, window)
    held = _oracle(q, k8.float(), v8.float(), pages, pos0, d ** -0.5, window)
    tol = 1e-5 * vc.abs().max().item()
    torch.testing.assert_close(got.double(), held, rtol=0, atol=tol)
    full = _oracle(q, kc, vc, pages, pos0, d ** -0.5, window)
    assert (got.double() - full).abs().max() > 10 * tol


def _steps(one_call: bool, shared: bool, f8: torch.dtype):
    """cached_attention_impl over fresh FP8 caches: a 10-token prefill of 2 sequences, two
    1-row decodes, a 3-row verify; with `one_call` the kernel writes the cache
    (write_attend_rows), else torch does (paged_kv._write_kv); `shared`: MLA's cache (the
    values the keys' leading dims)."""
    g = torch.Generator().manual_seed(6)
    hq, hkv, d, dv, ps = 4, 1, 40, 32, 4
    q = torch.randn(2, 15, hq, d, generator=g)
    k = torch.randn(2, 15, hkv, d, generator=g) * 3
    v = torch.randn(2, 15, hkv, dv, generator=g)
    pages = [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    kc = torch.full((10, ps, hkv, d), float("nan")).to(f8)
    vc = kc[..., :dv] if shared else torch.full((10, ps, hkv, dv), float("nan")).to(f8)
    outs = []
    for segs in ([(0, 0, 10), (1, 0, 10)], [(0, 10, 1), (1, 10, 1)], [(0, 11, 1), (1, 11, 1)],
                 [(0, 12, 3), (1, 12, 3)]):
        meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                               for s, st, ln in segs])
        slots = torch.cat([torch.tensor([pages[s][p // ps] * ps + p % ps
                                         for p in range(st, st + ln)]) for s, st, ln in segs])
        qq, kk, vv = (torch.cat([x[s, st:st + ln] for s, st, ln in segs])[None]
                      for x in (q, k, v))
        vv = kk[..., :dv] if shared else vv
        outs.append(ca.cached_attention_impl(qq, kk, vv, kc, vc, meta.cu_seqlens,
                                             meta.cu_seqlens, meta.cache_lens, meta.cache_lens,
                                             meta.page_table, d ** -0.5, 0,
                                             slots if one_call else None)[0])
    return outs, kc, vc, (q, pages)


@BOTH
@pytest.mark.parametrize("shared", [False, True], ids=["kv", "value-in-key"])
def test_kernel_writes_equal_torch_writes_and_verify_equals_decode(shared, f8):
    """The one-call path (kernel writes) and the torch writes fill the same bytes and give the
    same bits; a 3-row verify's rows = the float64 oracle over the cache; 1-row decodes of
    those positions give the verify rows' bits (batch invariance holds on FP8 too)."""
    a, kc_a, vc_a, (q, pages) = _steps(True, shared, f8)
    b, kc_b, vc_b, _ = _steps(False, shared, f8)
    assert torch.equal(kc_a.view(torch.uint8), kc_b.view(torch.uint8))
    assert torch.equal(vc_a.view(torch.uint8), vc_b.view(torch.uint8))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for s in (0, 1):
        want = _oracle(q[s, 12:15], kc_a.float(), vc_a.float(), torch.tensor(pages[s]), 12,
                       40 ** -0.5)
        torch.testing.assert_close(a[3][3 * s:3 * s + 3].double(), want, rtol=0, atol=1e-5)
        rows = [ar.attention_rows(q[s, p:p + 1], kc_a, vc_a, torch.tensor(pages[s]), p,
                                  40 ** -0.5) for p in (12, 13, 14)]
        assert torch.equal(torch.cat(rows), a[3][3 * s:3 * s + 3])


@BOTH
def test_mla_widths_on_fp8(f8):
    """DeepSeek's absorbed MLA on an FP8 cache (one KV head of 576 whose values are its first
    512 dims, attention_wide.c): = the float64 oracle over what the cache holds, and the generic
    C kernels give the AVX2 ones' bits."""
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(8, 16, 1, 576, generator=g).to(f8)
    vc = kc[..., :512]
    pages = torch.randperm(8, generator=g)
    q = torch.randn(3, 16, 576, generator=g)
    got = ar.attention_rows(q, kc, vc, pages, 97, 576 ** -0.5)
    with ar.wide_mode(every=True, scalar=True):
        assert torch.equal(ar.attention_rows(q, kc, vc, pages, 97, 576 ** -0.5), got)
    kf = kc.float()
    want = _oracle(q, kf, kf[..., :512], pages, 97, 576 ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * kf.abs().max().item())
