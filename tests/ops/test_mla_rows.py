"""The row kernel's wide-value path (ops/attention_wide.c) at DeepSeek's absorbed-MLA widths: one
KV head whose key is 576 dims and whose value is the key's first 512 (one cache), 16 or 128
query heads. Against a float64 softmax attention written here over the values the cache holds;
the scalar kernels give the AVX2 kernels' bits; a row's bits are the same alone, in a verify
segment or in a prefill chunk, at 1 or 2 threads; the one-call write + attend path and a tiny
DeepSeek deployment with kv_lora_rank 512 take it (counted in C), greedy = transformers'."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.ops import attention_rows as ar
from specdeploy.ops import cached_attention as ca

pytestmark = pytest.mark.skipif(ar.wide_unavailable() is not None,
                                reason=f"attention kernel unavailable: {ar.wide_unavailable()}")
D, DV, PS = 576, 512, 64
SCALE = 0.1352  # DeepSeek-V3's 192 ** -0.5 times its YaRN mscale squared, roughly


def _mla_cache(tokens: int, dtype=torch.float32, seed: int = 0):
    """A shuffled paged cache of 576-dim latent keys for `tokens` positions (+ a spare page
    of NaNs: keys past a row's position must never be read into its output) and its value
    view, the keys' first 512 dims."""
    g = torch.Generator().manual_seed(seed)
    n = -(-tokens // PS) + 1
    kc = torch.randn(n, PS, 1, D, generator=g).to(dtype)
    pages = torch.randperm(n, generator=g)
    past = torch.arange(tokens, n * PS)
    kc[pages[past // PS], past % PS] = float("nan")
    return kc, kc[..., :DV], pages


def _oracle(q, kc, vc, pages, pos0, scale, window=0, sinks=None):
    """float64 over the cache's values: row t attends keys 0..pos0 + t (the last `window`
    where window > 0); sinks [Hq] join each softmax's denominator and weigh no value."""
    hkv = kc.shape[2]
    keys = kc[pages].reshape(-1, hkv, kc.shape[-1]).double()
    vals = vc[pages].reshape(-1, hkv, vc.shape[-1]).double()
    out = []
    for t in range(q.shape[0]):
        n = pos0 + t + 1
        a = max(0, n - window) if window > 0 else 0
        qt = q[t].double().view(hkv, -1, q.shape[-1])  # [Hkv, rep, D]: heads by KV head
        s = torch.einsum("grd,ngd->grn", qt, keys[a:n]).flatten(0, 1) * scale
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), 1)
        w = s.softmax(-1)[:, :n - a].view(hkv, -1, n - a)
        out.append(torch.einsum("grn,ngd->grd", w, vals[a:n]).flatten(0, 1))
    return torch.stack(out)


def _q(t: int, hq: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, hq, D, generator=torch.Generator().manual_seed(seed))


# decode rows on either side of page boundaries, a verify segment (1 + 3 rows), a prefill chunk
CASES = [(16, 1, 63), (16, 1, 64), (16, 4, 3001), (16, 40, 2950), (128, 1, 2047),
         (128, 4, 130), (128, 33, 600)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,t,pos0", CASES)
def test_matches_the_float64_oracle(hq, t, pos0, dtype):
    """fp32 arithmetic over keys read exactly (bf16 widens without rounding), so the bf16 cache
    meets the same 1e-5 (of the largest value) as fp32 against the float64 attention over the
    values that cache holds; its distance to the fp32 keys before rounding is bf16's (2^-9
    relative per value), a property of the cache, not of the kernel."""
    kc, vc, pages = _mla_cache(pos0 + t, dtype)
    q = _q(t, hq)
    calls = ar.wide_calls()
    got = ar.attention_rows(q, kc, vc, pages, pos0, SCALE)
    assert ar.wide_calls() == calls + 1
    want = _oracle(q, kc.float(), vc.float(), pages, pos0, SCALE)
    top = kc[pages].reshape(-1, D)[:pos0 + t, :DV].float().abs().max()  # (NaNs past it)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,t,pos0", [(16, 1, 2500), (16, 5, 700), (128, 3, 300)])
def test_scalar_kernels_give_the_avx2_bits(hq, t, pos0, dtype):
    kc, vc, pages = _mla_cache(pos0 + t, dtype, seed=2)
    q = _q(t, hq, seed=3)
    fast = ar.attention_rows(q, kc, vc, pages, pos0, SCALE)
    with ar.wide_mode(every=False, scalar=True):
        assert torch.equal(ar.attention_rows(q, kc, vc, pages, pos0, SCALE), fast)


@pytest.mark.parametrize("hq", [16, 128])
def test_rows_are_batch_and_thread_invariant(hq):
    """A row's bits alone (decode), in a 4-row verify segment and in a 24-row prefill chunk,
    at 1 and 2 threads."""
    pos0, t = 1000 if hq == 16 else 250, 24
    kc, vc, pages = _mla_cache(pos0 + t, seed=4)
    q = _q(t, hq, seed=5)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            chunk = ar.attention_rows(q, kc, vc, pages, pos0, SCALE)
            for i in (0, 7, 23):
                assert torch.equal(ar.attention_rows(q[i:i + 1], kc, vc, pages, pos0 + i, SCALE),
                                   chunk[i:i + 1])
            assert torch.equal(ar.attention_rows(q[5:9], kc, vc, pages, pos0 + 5, SCALE),
                               chunk[5:9])
            outs.append(chunk)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("scalar", [False, True], ids=["avx2", "scalar"])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (45, False), (45, True)])
def test_separate_values_grouped_heads_windows_sinks(window, with_sinks, scalar):
    """The path's other inputs, at small widths (every width sent to it): values in a cache of
    their own, 2 KV heads of 3 query heads each, sliding windows, attention sinks."""
    g = torch.Generator().manual_seed(6)
    hq, hkv, d, dv, pos0, t = 6, 2, 40, 24, 70, 9
    kc, vc = torch.randn(12, 8, hkv, d, generator=g), torch.randn(12, 8, hkv, dv, generator=g)
    pages = torch.randperm(12, generator=g)
    q = torch.randn(t, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2 if with_sinks else None
    calls = ar.wide_calls()
    with ar.wide_mode(every=True, scalar=scalar):
        got = ar.attention_rows(q, kc, vc, pages, pos0, d ** -0.5, window, sinks)
        one = ar.attention_rows(q[4:5], kc, vc, pages, pos0 + 4, d ** -0.5, window, sinks)
    assert ar.wide_calls() == calls + 2
    assert torch.equal(one, got[4:5])
    want = _oracle(q, kc, vc, pages, pos0, d ** -0.5, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * vc.abs().max())


@pytest.mark.parametrize("one_call", [True, False], ids=["write-attend", "separate"])
def test_verify_rows_equal_decode_rows_through_cached_attention(one_call):
    """Two sequences through `cached_attention_impl` with MLA's one cache: a prefill, 1-row
    decodes, then a 4-row verify step; the verify rows are the decode rows' bits where they
    repeat the decodes' positions, the cache holds the keys, and the rows meet the oracle."""
    g = torch.Generator().manual_seed(7)
    hq, prefix, n = 16, 100, 4
    q = torch.randn(2, prefix + n, hq, D, generator=g)
    k = torch.randn(2, prefix + n, 1, D, generator=g)
    pages = [[0, 2], [3, 1]]
    kc = torch.zeros(4, PS, 1, D)
    vc = kc[..., :DV]

    def step(segs):
        meta = build_metadata([Segment([0] * ln, st, pages[s], s, ln, SEG_EXTEND)
                               for s, st, ln in segs])
        slots = torch.cat([torch.tensor([pages[s][p // PS] * PS + p % PS
                                         for p in range(st, st + ln)]) for s, st, ln in segs])
        qq = torch.cat([q[s, st:st + ln] for s, st, ln in segs])[None]
        kk = torch.cat([k[s, st:st + ln] for s, st, ln in segs])[None]
        return ca.cached_attention_impl(qq, kk, kk[..., :DV], kc, vc, meta.cu_seqlens,
                                        meta.cu_seqlens, meta.cache_lens, meta.cache_lens,
                                        meta.page_table, SCALE, 0,
                                        slots if one_call else None)[0]

    calls = ar.wide_calls()
    step([(0, 0, prefix), (1, 0, prefix)])
    decodes = [step([(0, prefix + i, 1), (1, prefix + i, 1)]) for i in range(2)]
    verify = step([(0, prefix, n), (1, prefix, n)])
    assert ar.wide_calls() > calls
    for s in (0, 1):
        rows = torch.cat([decodes[i][s:s + 1] for i in range(2)])
        assert torch.equal(verify[s * n:s * n + 2], rows)
        want = _oracle(q[s, prefix:], kc, vc, torch.tensor(pages[s]), prefix, SCALE)
        torch.testing.assert_close(verify[s * n:(s + 1) * n].double(), want, rtol=0, atol=1e-5)
        flat = kc[torch.tensor(pages[s])].reshape(-1, D)[:prefix + n]
        assert torch.equal(flat, k[s, :, 0])


def test_a_deepseek_deployment_with_a_512_latent_takes_the_c_path(tmp_path):
    """A tiny DeepSeek-V3 (2 layers, 4 heads) with kv_lora_rank 512: its absorbed attention's
    value width is 512, so the rows run in C (counted there, CPU graph replays included);
    greedy = transformers' `generate`."""
    transformers = pytest.importorskip("transformers")
    from specdeploy import LLM, SamplingParams
    from specdeploy.models import deepseek_v3 as ds

    hf = ds.tiny_hf_config()
    hf.update(kv_lora_rank=512, num_hidden_layers=2)
    path = ds.make_tiny(tmp_path, seed=5, hf_config=hf)
    calls = ar.wide_calls()
    outs = LLM(path, max_batch_size=2, max_seq_len=128).generate(
        ["hello there", "a b c d e f"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert ar.wide_calls() - calls >= 2 * 12  # every layer's rows, every step
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    for o in outs:
        t = torch.tensor([o.prompt_token_ids])
        want = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=12,
                              do_sample=False)[0, t.shape[1]:].tolist()
        assert o.token_ids == want


def test_generic_cache_writes_round_as_torch():
    """The cache writes of the generic C path (a CPU without F16C) round fp32 to fp16 as
    torch does (to nearest even; subnormals; 65520 and up to inf) and as the F16C path does."""
    g = torch.Generator().manual_seed(8)
    vals = torch.cat((torch.randn(D, generator=g), torch.randn(D, generator=g) * 1e-6,
                      torch.randn(D, generator=g) * 3e4,
                      torch.tensor([65504.0, 65519.0, 65520.0, 1e9, -0.0, 2.0 ** -25,
                                    3 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -26, 1 + 2.0 ** -11,
                                    1 + 3 * 2.0 ** -11, float("inf"), float("-inf")])))
    rows = vals[:(vals.numel() // D) * D].view(-1, D)
    t, hq = rows.shape[0], 2
    qk = torch.zeros(t, hq + 1, D)
    qk[:, hq] = rows
    caches = []
    for scalar in (False, True):
        kc = torch.zeros(1, PS, 1, D, dtype=torch.float16)
        with ar.wide_mode(every=False, scalar=scalar):
            ar.write_attend_rows(qk, qk.view(1, t, -1), 0, kc, kc[..., :DV],
                                 torch.arange(t), torch.tensor([0, t]), torch.tensor([0]),
                                 torch.tensor([[0]]), SCALE)
        caches.append(kc.view(-1, D)[:t])
    want = rows.to(torch.float16)
    assert torch.equal(caches[1].view(torch.int16), want.view(torch.int16))
    assert torch.equal(caches[0].view(torch.int16), want.view(torch.int16))


def test_without_avx2_only_the_wide_path_fits(monkeypatch):
    """Where the CPU lacks AVX2 the library still loads: value widths past 256 fit (their
    generic C path), the narrow kernel's widths do not (the torch fallback runs)."""
    lib = ar._library()[0]
    monkeypatch.setattr(ar, "_library", lambda: (lib, "this CPU lacks avx2"))
    kc = torch.zeros(2, PS, 1, D)
    assert ar.wide_unavailable() is None and ar.unavailable() is not None
    assert ar.fits(_q(1, 16), kc, kc[..., :DV])
    assert not ar.fits(torch.zeros(1, 4, 64), kc[..., :64], kc[..., :64])
