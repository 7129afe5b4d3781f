"""Each cached / canonical op's device path against its pure-torch `*_ref`, at odd lengths.

Why: off the CPU the ops take other code than the CPU tests exercise (cached attention: the
batched `_decode` and `extend_uniform` instead of the C row kernels; rms_norm, add_rms_norm,
silu_mul, uniform qkv_attention steps: Triton (ops/gpu_kernels.py), and with it off the torch
chains, both run here; the chunked scans on the device's matmuls). The oracle is the ref on the
CPU in float32; the op runs on DEVICE; compared on the CPU: max |error| <= tol * max |expected|
(fp32 1e-4, TF32 off; bf16 2e-2). Mutated caches too: paged K/V (garbage elsewhere: never read),
state slots, per-token spec states, prefix-cache checkpoints (NaN where nothing may be written).

DEVICE is $SPECDEPLOY_TEST_DEVICE (default "cuda": `cuda`-marked, skipped without a CUDA device);
SPECDEPLOY_TEST_DEVICE=cpu runs every check unmarked on the CPU paths, which must match too.
"""
from __future__ import annotations

import os
from itertools import accumulate
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import specdeploy.ops.cached_recurrent  # noqa: F401  (registers the cached_* scans)
from specdeploy.cache.metadata import SEG_EXTEND as E
from specdeploy.cache.metadata import SEG_NORMAL as N
from specdeploy.cache.metadata import Segment, build_metadata, kv_slot_mapping
from specdeploy.ops import gpu_kernels
from specdeploy.ops.attention import attention_ref
from specdeploy.ops.conv import causal_conv1d_ref
from specdeploy.ops.fused_rows import add_rms_norm_ref, silu_mul_ref
from specdeploy.ops.gdn import gated_delta_rule_ref
from specdeploy.ops.norm import rms_norm_ref
from specdeploy.ops.qkv_attention import qkv_attention_ref
from specdeploy.ops.rope import rope_cos_sin, rope_ref
from specdeploy.ops.ssm import ssm_scan_ref
from tests.ops.test_ops_conv import _inputs as conv_inputs
from tests.ops.test_ops_gdn import _inputs as gdn_inputs
from tests.ops.test_ops_ssm import DT_MAX, DT_MIN
from tests.ops.test_ops_ssm import _inputs as ssm_inputs

DEVICE = os.environ.get("SPECDEPLOY_TEST_DEVICE", "cuda")
pytestmark = [] if DEVICE == "cpu" else [pytest.mark.cuda]
ops = torch.ops.specdeploy
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # of the expected tensor's max |value|


@pytest.fixture(autouse=True)
def _fp32_inference():
    """No TF32 (would miss 1e-4); a fixed seed; inference mode as deployed (Triton RMSNorm)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with torch.inference_mode():
        yield


@pytest.fixture(params=[pytest.param("triton", marks=pytest.mark.filterwarnings("error")),
                        "torch"] if DEVICE == "cuda" else ["torch"])
def kernels(request, monkeypatch):
    """On CUDA, ops with Triton kernels run both with them (a failing one warns: an error here)
    and with the torch chains."""
    if request.param == "torch":
        monkeypatch.setattr(gpu_kernels, "enabled", lambda x: False)
        return
    monkeypatch.setitem(gpu_kernels._STATE, "on", True)  # off by default (ops/gpu_kernels.py)
    if not gpu_kernels.enabled(torch.empty(0, device=DEVICE)):
        pytest.skip("Triton is not importable here")


def _to(*xs):
    """Copies on DEVICE (copies on the CPU too: the op must never write the oracle's tensors)."""
    return tuple(x.to(DEVICE, copy=True) if isinstance(x, torch.Tensor) else x for x in xs)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL[torch.float32]) -> None:
    """max |actual - expected| <= tol * max |expected|, on the CPU (NaN anywhere fails)."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert a.shape == e.shape, (a.shape, e.shape)
    err, scale = (a - e).abs().max().item(), max(e.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:g} * scale {scale:.3g}"


# ---- row ops: rms_norm, add_rms_norm, silu_mul, rope -------------------------------------------


POS = torch.arange(13)[None] + torch.tensor([[0], [29]])  # [2, 13]: the second row from 29
CS = {r: rope_cos_sin(POS, 1.0 / 10000 ** (torch.arange(0, r, 2) / r)) for r in (16, 6)}
ROW_OPS = {  # name: (shapes of the inputs, drawn in the test's dtype; op; ref)
    "rms_norm": ([(3, 7, 37), (37,)], lambda *a: ops.rms_norm(*a, 1e-6),
                 lambda *a: rms_norm_ref(*a, 1e-6)),
    "add_rms_norm": ([(1, 13, 37), (1, 13, 37), (37,)], lambda *a: ops.add_rms_norm(*a, 1e-5),
                     lambda *a: add_rms_norm_ref(*a, 1e-5)),
    "silu_mul": ([(2, 9, 2 * 37 + 3)], lambda x: ops.silu_mul(x, 37),  # a row wider than 2N
                 lambda x: silu_mul_ref(x, 37)),
    **{f"rope_{r}": ([(2, 13, 3, 16)], lambda x, r=r: ops.rope(x, *_to(*CS[r])),
                     lambda x, r=r: rope_ref(x, *CS[r])) for r in (16, 6)},  # full, partial
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ROW_OPS)
def test_row_op(name, dtype, kernels):
    """The op on `dtype` inputs on DEVICE vs the ref on their float32 copies on the CPU."""
    shapes, op, ref = ROW_OPS[name]
    xs = [torch.randn(*s).to(dtype) for s in shapes]
    got, want = op(*_to(*xs)), ref(*(x.float() for x in xs))
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):  # add_rms_norm: (a + b, its norm)
        assert g.dtype == dtype
        _close(g, w, TOL[dtype])


# ---- canonical scans: causal conv1d, Mamba2 SSD, gated delta rule (chunked) --------------------


def _scan_case(name: str, t: int = 37):
    """(op, ref, args): batch 2, an initial state, chunks of 16 (the last one partial)."""
    if name == "causal_conv1d":
        return ops.causal_conv1d, causal_conv1d_ref, (*conv_inputs(t), "silu")
    if name == "ssm_scan":
        return ops.ssm_scan, ssm_scan_ref, (*ssm_inputs(t).values(),  # x, dt, A, B, C, D, bias
                                            DT_MIN, DT_MAX, 16, torch.randn(2, 4, 3, 5))
    return ops.gated_delta_rule, gated_delta_rule_ref, (*gdn_inputs(t, h=4, hk=2),
                                                        torch.randn(2, 4, 8, 6), True, 0.3, 16)


@pytest.mark.parametrize("name", ["causal_conv1d", "ssm_scan", "gated_delta_rule"])
def test_scan_op(name):
    op, ref, args = _scan_case(name)
    for got, want in zip(op(*_to(*args)), ref(*args)):  # (output, final state)
        _close(got, want)


# ---- paged cached attention and qkv_attention --------------------------------------------------

STEPS = {  # (cache_len, new tokens) per sequence
    "decode": [(6, 1), (0, 1), (13, 1), (4, 1)],
    "verify": [(5, 4), (11, 4), (2, 4)],  # 1 + K queries each: extend_uniform off the CPU
    "mixed": [(0, 9), (7, 1), (4, 6), (12, 1)],  # prefill, decode, chunk continuation, decode
}
D, PAGE, SCALE = 16, 3, 0.25
ATTENTION = pytest.mark.parametrize("hq,hkv,window", [(4, 4, 0), (6, 2, 0), (4, 4, 5), (6, 2, 5)],
                                    ids=["mha", "gqa", "mha-window", "gqa-window"])


def _paged(cache, pages, xs, upto) -> torch.Tensor:
    """A copy of `cache` with rows 0..upto-1 of each sequence's x [1, L, H, D] in its pages."""
    out = cache.clone()
    for pg, x, n in zip(pages, xs, upto):
        for p in range(n):
            out[pg[p // PAGE], p % PAGE] = x[0, p]
    return out


def _kv_step(segs, hq, hkv, dv):
    """-> (q, k, v) of each whole sequence, its pages, K/V caches (garbage + prefixes), meta."""
    seqs = [(torch.randn(1, c + n, hq, D), torch.randn(1, c + n, hkv, D),
             torch.randn(1, c + n, hkv, dv)) for c, n in segs]
    need = [-(-(c + n) // PAGE) for c, n in segs]
    pool = torch.randperm(sum(need) + 2).tolist()  # out of order, two pages never used
    pages = [pool[a:b] for a, b in zip([0, *accumulate(need)], accumulate(need))]
    lens = [c for c, _ in segs]
    kc = _paged(1e3 * torch.randn(len(pool), PAGE, hkv, D), pages, [s[1] for s in seqs], lens)
    vc = _paged(1e3 * torch.randn(len(pool), PAGE, hkv, dv), pages, [s[2] for s in seqs], lens)
    meta = build_metadata([Segment([0] * n, c, pg, i)
                           for i, ((c, n), pg) in enumerate(zip(segs, pages))])
    return seqs, pages, kc, vc, meta


def _new(seqs, meta, col) -> torch.Tensor:
    """The step's new rows of `col` (a function of (q, k, v)), flattened: [1, T, ...]."""
    return torch.cat([col(*x)[:, c:] for x, c in zip(seqs, meta.cache_lens.tolist())], dim=1)


@ATTENTION
@pytest.mark.parametrize("step", STEPS)
def test_cached_attention(step, window, hq, hkv):
    """Output vs attention_ref over each whole sequence; caches vs every sequence written."""
    seqs, pages, kc, vc, m = _kv_step(STEPS[step], hq, hkv, dv=8)
    md, (kd, vd) = m.to(DEVICE), _to(kc, vc)
    q, k, v = (_new(seqs, m, lambda *x, i=i: x[i]) for i in range(3))
    out = ops.cached_attention(*_to(q, k, v), kd, vd, md.cu_seqlens, m.cu_seqlens, md.cache_lens,
                               m.cache_lens, md.page_table, SCALE, window)
    _close(out, _new(seqs, m, lambda *x: attention_ref(*x, SCALE, window)))
    full = [x[0].shape[1] for x in seqs]
    _close(kd, _paged(kc, pages, [x[1] for x in seqs], full))
    _close(vd, _paged(vc, pages, [x[2] for x in seqs], full))


@ATTENTION
@pytest.mark.parametrize("step", STEPS)
def test_qkv_attention(step, window, hq, hkv, kernels):
    """The fused op (partial RoPE, slot_mapping writes) vs qkv_attention_ref: output, caches.
    Dv = D: Triton takes the uniform steps (decode, verify) without a window on CUDA."""
    seqs, _, kc, vc, m = _kv_step(STEPS[step], hq, hkv, dv=D)
    md, (kd, vd) = m.to(DEVICE), _to(kc, vc)
    qkv = _new(seqs, m, lambda q, k, v: torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1))
    cos, sin = rope_cos_sin(m.position_ids[None], 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    slots = kv_slot_mapping(m, PAGE)
    out = ops.qkv_attention(*_to(qkv, cos, sin), kd, vd, md.cu_seqlens, m.cu_seqlens,
                            md.cache_lens, m.cache_lens, md.page_table, SCALE, window,
                            slots.to(DEVICE), hq, hkv, D)
    want = qkv_attention_ref(qkv, cos, sin, kc, vc, m.cu_seqlens, m.cu_seqlens, m.cache_lens,
                             m.cache_lens, m.page_table, SCALE, window, slots, hq, hkv, D)
    for got, expected in ((out, want), (kd, kc), (vd, vc)):
        _close(got, expected)


# ---- state-slot recurrent ops (ops/cached_recurrent.py, ops/scan_states.py) -------------------


class Rec(NamedTuple):
    state: tuple  # one slot's state shape
    make: object  # n -> per-token inputs, each [1, n, ...]
    call: object  # (xs, state, spec_state, (cu, lens, slot_idx, kinds), ckpt kwargs) -> y
    ref: object  # (xs, initial state [1, ...] | None) -> (y, final state)


def _conv_case(c=5, w=4) -> Rec:
    p = torch.randn(c, w), torch.randn(c)  # weight, bias
    pd = _to(*p)
    return Rec((c, w - 1), lambda n: (torch.randn(1, n, c),),
               lambda xs, st, sp, m, ck: ops.cached_causal_conv1d(
                   *xs, *pd, st, sp, *m, "silu", **ck),
               lambda xs, s0: causal_conv1d_ref(*xs, *p, s0, "silu"))


def _ssm_case(h=4, hp=3, g=2, n=5) -> Rec:
    p = -torch.rand(h) * 4, torch.randn(h), torch.randn(h)  # A, D, dt_bias
    pd = _to(*p)
    return Rec((h, hp, n),
               lambda t: (torch.randn(1, t, h, hp), torch.randn(1, t, h), torch.randn(1, t, g, n),
                          torch.randn(1, t, g, n)),
               lambda xs, st, sp, m, ck: ops.cached_ssm_scan(
                   *xs[:2], pd[0], *xs[2:], *pd[1:], st, sp, *m, DT_MIN, DT_MAX, CHUNK, **ck),
               lambda xs, s0: ssm_scan_ref(*xs[:2], p[0], *xs[2:], *p[1:], DT_MIN, DT_MAX, 0, s0))


def _gdn_case(h=4, hk=2, k=8, v=6) -> Rec:
    return Rec((h, k, v),
               lambda t: (torch.randn(1, t, hk, k), torch.randn(1, t, hk, k),
                          torch.randn(1, t, h, v), -F.softplus(torch.randn(1, t, h)),
                          torch.rand(1, t, h)),
               lambda xs, st, sp, m, ck: ops.cached_gated_delta_rule(
                   *xs, st, sp, *m, True, 0.0, CHUNK, **ck),
               lambda xs, s0: gated_delta_rule_ref(*xs, s0, True, 0.0))


RECURRENT = {"conv": _conv_case, "ssm": _ssm_case, "gdn": _gdn_case}
SCHEDULES = {  # (cache_len, tokens, kind) per sequence; sequence i owns slot SLOTS[i]
    "prefill_decode": [(3, 1, N), (0, 11, N), (9, 1, N), (5, 7, N)],
    "verify_uniform": [(6, 4, E), (2, 4, E), (13, 4, E)],
    "verify_mixed": [(6, 4, E), (9, 1, N), (2, 3, E), (0, 5, N)],
}
SLOTS, NUM_SLOTS, SPEC, CHUNK = (4, 0, 5, 2), 6, 5, 4
# prefill_decode's checkpoints (segment, token): mid-chunk, chunk end, segment end, chained, decode
CKPT = [(1, 2), (1, 3), (1, 6), (1, 10), (3, 1), (3, 2), (2, 0)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", RECURRENT)
def test_cached_recurrent(name, schedule):
    """Outputs vs the ref from each slot's state (zeros when fresh: the slot holds NaN); NORMAL:
    slot = final state; EXTEND: spec_state[slot, j] = state after token j, slot untouched."""
    case, segs = RECURRENT[name](), SCHEDULES[schedule]
    xs = [case.make(n) for _, n, _ in segs]
    s0 = [torch.randn(1, *case.state) if c else None for c, _, _ in segs]
    state = torch.full((NUM_SLOTS, *case.state), torch.nan)
    for slot, s in zip(SLOTS, s0):
        if s is not None:
            state[slot] = s[0]
    cks = CKPT if schedule == "prefill_decode" else []
    st, spec, ckpt = _to(state, torch.full((NUM_SLOTS, SPEC, *case.state), torch.nan),
                         torch.full((8, *case.state), torch.nan))
    cu = [0, *accumulate(n for _, n, _ in segs)]
    meta = (torch.tensor(cu), torch.tensor([c for c, _, _ in segs]),
            torch.tensor(SLOTS[:len(segs)], device=DEVICE), torch.tensor([k for *_, k in segs]))
    ck = {} if not cks else {
        "ckpt": ckpt, "ckpt_tokens_host": torch.tensor([cu[s] + i for s, i in cks]),
        "ckpt_slots": torch.arange(len(cks), device=DEVICE)}
    y = case.call(_to(*(torch.cat(parts, dim=1) for parts in zip(*xs))), st, spec, meta, ck)

    def after(s: int, n: int) -> torch.Tensor:  # the ref's state after token n - 1 of segment s
        return case.ref([x[:, :n] for x in xs[s]], s0[s])[1][0]

    for s, (_, n, kind) in enumerate(segs):
        slot = SLOTS[s]
        _close(y[:, cu[s]:cu[s + 1]], case.ref(xs[s], s0[s])[0])
        if kind == N:
            _close(st[slot], after(s, n))
            assert torch.isnan(spec[slot]).all(), "a NORMAL segment wrote spec states"
        else:
            assert torch.equal(st[slot].cpu(), state[slot]), "EXTEND touched the main state"
            for j in range(n):
                _close(spec[slot, j], after(s, j + 1))
            assert torch.isnan(spec[slot, n:]).all(), "spec entries past the segment written"
    for w, (s, i) in enumerate(cks):
        _close(ckpt[w], after(s, i + 1))
    assert torch.isnan(ckpt[len(cks):]).all(), "unasked checkpoints written"
    for slot in set(range(NUM_SLOTS)) - set(SLOTS[:len(segs)]):
        assert torch.isnan(st[slot]).all() and torch.isnan(spec[slot]).all()
