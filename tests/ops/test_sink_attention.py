"""Attention sinks (gpt-oss) in the attention ops, and the biased clamped-SwiGLU experts op.

Oracles: an explicit per-query formula written here (each row's weights exp(s_j) / (exp(sink) +
sum_j exp(s_j)) over its visible keys) and the ops' `*_ref`s. Tolerance: 1e-5 of the output's
scale (fp32; the kernels sum in other orders). The cached paths (ops/sink_attention.py) run
through tests/deploy/test_cached_ops.py's schedules too (its `attention_sinks*` cases).
"""
from __future__ import annotations

import math

import pytest
import torch

import specdeploy.ops  # noqa: F401
import specdeploy.ops.cached_attention  # noqa: F401  (registers the cached ops this file calls)
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.ops import sink_attention
from specdeploy.ops.attention import attention_ref
from specdeploy.ops.moe_bias import _gather, _grouped, _pairwise, moe_experts_bias_ref

ops = torch.ops.specdeploy
RTOL = 1e-5


def explicit_sink_attention(q, k, v, scale, window, sinks):
    """Per query i and head h: sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m)),
    j over the visible keys (i - w + 1 .. i), in float64."""
    b, t, hq, _ = q.shape
    kv_head = torch.arange(hq) // (hq // k.shape[2])
    q, k, v, sinks = q.double(), k[:, :, kv_head].double(), v[:, :, kv_head].double(), \
        sinks.double()
    out = torch.zeros(b, t, hq, v.shape[-1], dtype=torch.float64)
    for i in range(t):
        lo = 0 if window == 0 else max(0, i - window + 1)
        s = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, lo:i + 1]) * scale
        m = torch.maximum(s.amax(-1), sinks[None])
        e = (s - m[..., None]).exp()
        den = e.sum(-1) + (sinks[None] - m).exp()
        out[:, i] = torch.einsum("bhj,bjhd->bhd", e / den[..., None], v[:, lo:i + 1])
    return out


def _close(got, want, rtol=RTOL):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rtol * want.double().abs().max().item(), err


@pytest.mark.parametrize("t", (1, 9, 70))
@pytest.mark.parametrize("hq,hkv,window", [(4, 4, 0), (4, 2, 0), (6, 2, 5), (4, 1, 64)])
def test_attention_with_sinks_matches_explicit(t, hq, hkv, window):
    g = torch.Generator().manual_seed(t + hq + window)
    q, k = torch.randn(2, t, hq, 16, generator=g), torch.randn(2, t, hkv, 16, generator=g)
    v, sinks = torch.randn(2, t, hkv, 8, generator=g), 2 * torch.randn(hq, generator=g)
    scale = 1 / math.sqrt(16)
    want = explicit_sink_attention(q, k, v, scale, window, sinks)
    _close(ops.attention(q, k, v, scale, window, sinks), want)
    _close(attention_ref(q, k, v, scale, window, sinks), want)


def test_sinks_change_the_output_and_minus_inf_removes_them():
    q, k, v = torch.randn(1, 12, 4, 8), torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    plain = ops.attention(q, k, v, 0.3, 0)
    assert (ops.attention(q, k, v, 0.3, 0, torch.zeros(4)) - plain).abs().max() > 1e-2
    _close(ops.attention(q, k, v, 0.3, 0, torch.full((4,), float("-inf"))), plain)


def test_bf16_keeps_dtype():
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = ops.attention(q, k, v, 0.5, 3, torch.randn(2))
    assert out.dtype == torch.bfloat16


def _paged(hq=4, hkv=2, d=8, lengths=(11, 5), page_size=3, seed=0):
    """Caches filled with garbage and each sequence's pages out of order."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    pool = torch.randperm(sum(need) + 2, generator=g).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(pool[start:start + n])
        start += n
    kc = 1e3 * torch.randn(len(pool), page_size, hkv, d, generator=g)
    vc = 1e3 * torch.randn(len(pool), page_size, hkv, d, generator=g)
    seqs = [(torch.randn(1, n, hq, d, generator=g), torch.randn(1, n, hkv, d, generator=g),
             torch.randn(1, n, hkv, d, generator=g)) for n in lengths]
    return kc, vc, pages, seqs


def _step(kc, vc, pages, seqs, segs, scale, window, sinks, torch_paths=False):
    """segs: [(seq, start, n)] -> the op's output per segment; `torch_paths`: the torch sink
    paths themselves (on the CPU the op takes the C row kernel where it fits)."""
    meta = build_metadata([Segment([0] * n, a, pages[i], 0) for i, a, n in segs])
    flat = [torch.cat([x[:, a:a + n] for i, a, n in segs for x in [seqs[i][j]]], 1)
            for j in range(3)]
    args = (*flat, kc, vc, meta.cu_seqlens, meta.cu_seqlens, meta.cache_lens, meta.cache_lens,
            meta.page_table, scale, window)
    y = (sink_attention.cached_attention_sinks(*args, None, sinks) if torch_paths
         else ops.cached_attention(*args, sinks=sinks))
    return [y[:, meta.cu_seqlens[s]:meta.cu_seqlens[s + 1]] for s in range(len(segs))]


@pytest.mark.parametrize("torch_paths", (False, True), ids=("op", "torch_paths"))
@pytest.mark.parametrize("window", (0, 4))
def test_verify_rows_are_the_decode_rows_bit_for_bit(window, torch_paths):
    """A 4-row segment (a verify step) gives each row the bits plain decoding gives it alone:
    lossless greedy speculation rests on it."""
    sinks, scale = torch.randn(4), 8**-0.5
    kc, vc, pages, seqs = _paged(lengths=(11, 7))
    _step(kc, vc, pages, seqs, [(0, 0, 7), (1, 0, 3)], scale, window, sinks, torch_paths)
    verify = _step(kc, vc, pages, seqs, [(0, 7, 4), (1, 3, 4)], scale, window, sinks,
                   torch_paths)
    decode = [[], []]
    for j in range(4):
        for s, y in enumerate(_step(kc, vc, pages, seqs, [(0, 7 + j, 1), (1, 3 + j, 1)], scale,
                                    window, sinks, torch_paths)):
            decode[s].append(y)
    for s in range(2):
        assert torch.equal(verify[s], torch.cat(decode[s], 1))
        full = attention_ref(*seqs[s], scale, window, sinks)
        _close(verify[s], full[:, -4:])


@pytest.mark.parametrize("n", (1, 3))
def test_batched_path_matches_ref(n):
    """The static-shape path taken off the CPU (decodes, uniform verify steps), run here."""
    sinks, scale, window = torch.randn(4), 8**-0.5, 5
    kc, vc, pages, seqs = _paged(lengths=(13, 9))
    _step(kc, vc, pages, seqs, [(0, 0, 13), (1, 0, 9)], scale, window, sinks)  # (the keys)
    meta = build_metadata([Segment([0] * n, 13 - n, pages[0], 0),
                           Segment([0] * n, 9 - n, pages[1], 0)])
    q = torch.cat([seqs[0][0][0, -n:], seqs[1][0][0, -n:]])
    got = sink_attention._batched(q, kc, vc, meta.page_table, meta.cache_lens, scale, window,
                                  sinks, n)
    for s in range(2):
        want = attention_ref(*seqs[s], scale, window, sinks)[0, -n:]
        _close(got[s * n:(s + 1) * n], want)


@pytest.mark.parametrize("torch_paths", (False, True), ids=("op", "torch_paths"))
def test_sinks_of_the_wrong_size_are_refused(torch_paths):
    kc, vc, pages, seqs = _paged()
    with pytest.raises(ValueError, match="one per query head"):
        _step(kc, vc, pages, seqs, [(0, 0, 3)], 0.3, 0, torch.randn(3), torch_paths)


def test_torch_paths_prefill_chunks_match_ref():
    """Segments longer than the per-row limit (prefill chunks: one masked SDPA each)."""
    sinks, scale, window = torch.randn(4), 8**-0.5, 6
    kc, vc, pages, seqs = _paged(lengths=(40, 25))
    first = _step(kc, vc, pages, seqs, [(0, 0, 30), (1, 0, 25)], scale, window, sinks, True)
    rest = _step(kc, vc, pages, seqs, [(0, 30, 10)], scale, window, sinks, True)
    _close(torch.cat((first[0], rest[0]), 1), attention_ref(*seqs[0], scale, window, sinks))
    _close(first[1], attention_ref(*seqs[1], scale, window, sinks))


# ---- experts with biases, gpt-oss's clamped SwiGLU ------------------------------------------


def _experts(e=6, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # large enough that the clamps at +-limit bite
    return (2 * torch.randn(e, 2 * i, h, generator=g), torch.randn(e, 2 * i, generator=g),
            torch.randn(e, h, i, generator=g) / 3, torch.randn(e, h, generator=g))


def _routing(t, e=6, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def explicit_expert(x, w_up, b_up, w_down, b_down, alpha, limit):
    """One expert on one row, written out: gate = h[:I], up = h[I:] (our de-interleaved rows)."""
    h = w_up.double() @ x.double() + b_up.double()
    i = h.shape[0] // 2
    gate, up = h[:i].clamp(max=limit), h[i:].clamp(-limit, limit)
    return w_down.double() @ ((up + 1) * gate / (1 + torch.exp(-alpha * gate))) + b_down.double()


@pytest.mark.parametrize("t", (1, 5, 40))
def test_moe_experts_bias_matches_explicit(t):
    w_up, b_up, w_down, b_down = _experts()
    x = torch.randn(t, 16)
    ids, weights = _routing(t)
    want = torch.stack([sum(weights[r, j].double() * explicit_expert(
        x[r], w_up[ids[r, j]], b_up[ids[r, j]], w_down[ids[r, j]], b_down[ids[r, j]], 1.702, 7.0)
        for j in range(2)) for r in range(t)])
    hw = w_up[ids.flatten()] @ x.repeat_interleave(2, 0)[:, :, None] + b_up[ids.flatten(), :, None]
    assert (hw.abs() > 7).any(), "the clamps never bit"
    args = (x, ids, weights, w_up, b_up, w_down, b_down)
    _close(ops.moe_experts_bias(*args, "swiglu_oai", 1.702, 7.0), want)
    _close(moe_experts_bias_ref(*args, "swiglu_oai", 1.702, 7.0), want)
    for path in (_pairwise, _grouped, _gather):
        _close(path(*args, 1.702, 7.0), want)


def test_moe_experts_bias_rows_are_batch_invariant():
    w_up, b_up, w_down, b_down = _experts()
    x = torch.randn(4, 16)
    ids, weights = _routing(4)
    together = ops.moe_experts_bias(x, ids, weights, w_up, b_up, w_down, b_down, "swiglu_oai",
                                    1.702, 7.0)
    for r in range(4):
        alone = ops.moe_experts_bias(x[r:r + 1], ids[r:r + 1], weights[r:r + 1], w_up, b_up,
                                     w_down, b_down, "swiglu_oai", 1.702, 7.0)
        assert torch.equal(alone, together[r:r + 1])


def test_moe_experts_bias_refuses_an_unknown_activation():
    w_up, b_up, w_down, b_down = _experts()
    ids, weights = _routing(2)
    with pytest.raises(ValueError, match="activation 'swiglu'"):
        ops.moe_experts_bias(torch.randn(2, 16), ids, weights, w_up, b_up, w_down, b_down,
                             "swiglu", 1.702, 7.0)
