"""Cached ops against their `*_ref` over the whole sequence.

Each test drives one cached op through a schedule of steps (prefill, chunked-prefill continuation,
decode, and ragged batches that mix them), feeding per-step metadata the way the engine does
(`build_metadata`), with pages handed out of order and small page sizes so sequences cross pages.
The outputs of every step, stitched back per sequence, must equal the op's ref run once over the
whole sequence (fp32; max error ≤ 1e-4 of the output's scale: the chunked kernels sum in a
different order than the token-by-token refs).

Caches start filled with garbage (KV) or NaN (state slots): a fresh sequence must never read
what an earlier occupant left behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import specdeploy.ops  # noqa: F401  (registers the canonical ops)
import specdeploy.ops.cached_attention  # noqa: F401
import specdeploy.ops.cached_recurrent  # noqa: F401
from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.ops import (
    attention_ref,
    causal_conv1d_ref,
    gated_delta_rule_ref,
    ssm_scan_ref,
)

ops = torch.ops.specdeploy
NUM_SLOTS = 6
DT_MIN, DT_MAX = 1e-3, 5.0
CHUNK = 16  # recurrent kernels' chunk: the longer segments span several chunks


# ---- one op = per-sequence inputs, a cached call, a ref and (recurrent) a state ----------------


@dataclass
class OpCase:
    name: str
    make: object  # (L) -> tuple of [1, L, ...] per-token inputs
    call: object  # (flat inputs, meta, caches) -> [1, T, ...]
    ref: object  # (inputs over a whole sequence) -> (y [1, L, ...], final state [1, ...] | None)
    caches: object  # (page_size) -> dict of cache tensors


def _attention_case(hq=4, hkv=2, d=8, dv=6, window=0, num_pages=160, sinks=False) -> OpCase:
    scale = d**-0.5
    # attention sinks (gpt-oss): one logit per query head in every softmax's denominator
    sink = 2 * torch.randn(hq, generator=torch.Generator().manual_seed(5)) if sinks else None

    def make(n):
        return torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, dv)

    def caches(page_size):
        # garbage everywhere: stale keys must be masked, never read
        return {"k": 1e3 * torch.randn(num_pages, page_size, hkv, d),
                "v": 1e3 * torch.randn(num_pages, page_size, hkv, dv)}

    def call(xs, meta, c):
        return ops.cached_attention(*xs, c["k"], c["v"], meta.cu_seqlens, meta.cu_seqlens,
                                    meta.cache_lens, meta.cache_lens, meta.page_table, scale,
                                    window, sinks=sink)

    def ref(xs):
        return attention_ref(*xs, scale, window, sink), None

    return OpCase(f"attention(window={window}, sinks={sinks})", make, call, ref, caches)


def _conv_case(c=6, w=4) -> OpCase:
    weight, bias = torch.randn(c, w), torch.randn(c)

    def make(n):
        return (torch.randn(1, n, c),)

    def caches(page_size):
        return {"state": torch.full((NUM_SLOTS, c, w - 1), float("nan")),
                "spec": torch.full((NUM_SLOTS, 5, c, w - 1), float("nan"))}

    def call(xs, meta, s):
        return ops.cached_causal_conv1d(xs[0], weight, bias, s["state"], s.get("spec"),
                                        meta.cu_seqlens, meta.cache_lens, meta.slot_idx,
                                        meta.seg_kind, "silu")

    def ref(xs):
        y, state = causal_conv1d_ref(xs[0], weight, bias, None, "silu")
        return y, state

    return OpCase("causal_conv1d", make, call, ref, caches)


def _ssm_case(h=4, p=3, g=2, n=5) -> OpCase:
    A, D, dt_bias = -torch.rand(h) * 4, torch.randn(h), torch.randn(h)

    def make(t):
        return (torch.randn(1, t, h, p), torch.randn(1, t, h), torch.randn(1, t, g, n),
                torch.randn(1, t, g, n))

    def caches(page_size):
        return {"state": torch.full((NUM_SLOTS, h, p, n), float("nan")),
                "spec": torch.full((NUM_SLOTS, 5, h, p, n), float("nan"))}

    def call(xs, meta, s):
        x, dt, B, C = xs
        return ops.cached_ssm_scan(x, dt, A, B, C, D, dt_bias, s["state"], s.get("spec"),
                                   meta.cu_seqlens, meta.cache_lens, meta.slot_idx,
                                   meta.seg_kind, DT_MIN, DT_MAX, CHUNK)

    def ref(xs):
        x, dt, B, C = xs
        return ssm_scan_ref(x, dt, A, B, C, D, dt_bias, DT_MIN, DT_MAX)

    return OpCase("ssm_scan", make, call, ref, caches)


def _gdn_case(h=4, hk=2, k=8, v=6) -> OpCase:
    def make(t):
        g = -torch.nn.functional.softplus(torch.randn(1, t, h))
        return (torch.randn(1, t, hk, k), torch.randn(1, t, hk, k), torch.randn(1, t, h, v), g,
                torch.rand(1, t, h))

    def caches(page_size):
        return {"state": torch.full((NUM_SLOTS, h, k, v), float("nan")),
                "spec": torch.full((NUM_SLOTS, 5, h, k, v), float("nan"))}

    def call(xs, meta, s):
        return ops.cached_gated_delta_rule(*xs, s["state"], s.get("spec"), meta.cu_seqlens,
                                           meta.cache_lens, meta.slot_idx, meta.seg_kind, True,
                                           0.0, CHUNK)

    def ref(xs):
        return gated_delta_rule_ref(*xs, None, True, 0.0)

    return OpCase("gated_delta_rule", make, call, ref, caches)


CASES = {
    "attention": _attention_case,
    "attention_gqa_window": lambda: _attention_case(hq=6, hkv=2, d=8, dv=8, window=5),
    "attention_mha": lambda: _attention_case(hq=2, hkv=2, d=4, dv=4),
    "attention_sinks": lambda: _attention_case(sinks=True),
    "attention_sinks_window": lambda: _attention_case(hq=6, hkv=2, d=8, dv=8, window=5,
                                                      sinks=True),
    "conv": _conv_case,
    "ssm": _ssm_case,
    "gdn": _gdn_case,
}
RECURRENT = ("conv", "ssm", "gdn")


# ---- the driver: steps of (sequence, tokens) segments -------------------------------------------


class Driver:
    """Runs `case` over sequences of the given lengths; each sequence owns pages (shuffled across
    the pool) and a slot; `step` feeds one flattened ragged batch."""

    def __init__(self, case: OpCase, lengths, page_size: int, slots=None, seed: int = 0):
        torch.manual_seed(seed)
        self.case = case
        self.inputs = [case.make(n) for n in lengths]
        self.page_size = page_size
        self.caches = case.caches(page_size)
        need = [-(-n // page_size) for n in lengths]
        pool = torch.randperm(sum(need) + 3).tolist()  # out of order, some pages never used
        self.pages, start = [], 0
        for k in need:
            self.pages.append(pool[start:start + k])
            start += k
        self.slots = list(slots) if slots is not None else [(2 * i + 1) % NUM_SLOTS
                                                            for i in range(len(lengths))]
        self.done = [0] * len(lengths)
        self.outs: list[list[torch.Tensor]] = [[] for _ in lengths]

    def step(self, segs, kind=SEG_NORMAL) -> list[torch.Tensor]:
        """segs: [(seq, n_tokens)] or [(seq, n_tokens, kind)]; returns each segment's output.
        NORMAL segments advance the sequence; EXTEND ones leave it where it was."""
        metas, pieces = [], []
        for seg in segs:
            i, n = seg[:2]
            k = seg[2] if len(seg) > 2 else kind
            a = self.done[i]
            assert a + n <= self.inputs[i][0].shape[1], "schedule runs past the sequence"
            metas.append(Segment([0] * n, a, self.pages[i], self.slots[i], kind=k))
            pieces.append([x[:, a:a + n] for x in self.inputs[i]])
        meta = build_metadata(metas)
        flat = [torch.cat(parts, dim=1) for parts in zip(*pieces)]
        y = self.case.call(flat, meta, self.caches)
        assert y.shape[:2] == (1, meta.num_tokens)
        outs = []
        for s, seg in enumerate(segs):
            part = y[:, meta.cu_seqlens[s]:meta.cu_seqlens[s + 1]]
            outs.append(part)
            if (seg[2] if len(seg) > 2 else kind) == SEG_NORMAL:
                self.outs[seg[0]].append(part)
                self.done[seg[0]] += seg[1]
        return outs

    def check(self, close) -> None:
        for i, xs in enumerate(self.inputs):
            assert self.done[i] == xs[0].shape[1], f"sequence {i} not fully fed"
            y_ref, _ = self.case.ref(xs)
            close(torch.cat(self.outs[i], dim=1), y_ref)


def _schedule_chunks(driver: Driver, seq: int, splits) -> None:
    for n in splits:
        driver.step([(seq, n)])


# ---- prefill / chunked prefill / decode ---------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("length", (1, 7, 63, 130))
def test_prefill(case, length, close):
    d = Driver(CASES[case](), [length], page_size=5)
    d.step([(0, length)])
    d.check(close)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits", [(1, 7, 63, 130), (130, 1, 7, 63), (63, 63, 5), (2,) * 9 + (1,),
                                    (7, 7, 7)], ids=lambda s: "+".join(map(str, s)))
def test_chunked_prefill(case, splits, close):
    d = Driver(CASES[case](), [sum(splits)], page_size=3)
    _schedule_chunks(d, 0, splits)
    d.check(close)


@pytest.mark.parametrize("case", CASES)
def test_decode_batch(case, close):
    """Three sequences with different prefixes, then batched one-token decode steps."""
    prompts, steps = (7, 1, 12), 9
    d = Driver(CASES[case](), [p + steps for p in prompts], page_size=5)
    for i, p in enumerate(prompts):
        d.step([(i, p)])
    for _ in range(steps):
        d.step([(i, 1) for i in range(len(prompts))])
    d.check(close)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", (3, 5))
def test_mixed_ragged_batch(case, page_size, close):
    """Prefill, chunk continuation and decode segments in one call, slots not in order; steps
    with equal-length segments where only some have a cached prefix, or that are not adjacent
    (the batched paths)."""
    lengths = (20, 9, 40, 14)
    d = Driver(CASES[case](), lengths, page_size, slots=(4, 0, 5, 2))
    d.step([(0, 6), (1, 8)])  # two fresh prefills
    d.step([(1, 1), (0, 7), (2, 3)])  # decode, continuation, fresh prefill
    d.step([(2, 7), (3, 7)])  # same length: one with a prefix, one fresh
    d.step([(3, 1), (2, 1), (0, 1)])  # pure decode, slots out of order
    d.step([(0, 1), (2, 20), (3, 1)])  # two decodes around a prefill chunk (batched together)
    d.step([(0, 5), (3, 5), (2, 9)])
    d.check(close)


# ---- EXTEND (speculative verify): per-token states go to spec_state only ----------------------


@pytest.mark.parametrize("case", RECURRENT)
@pytest.mark.parametrize("uniform", (True, False), ids=("uniform", "ragged"))
def test_extend_writes_spec_state(case, uniform, close):
    op = CASES[case]()
    prefixes = (9, 4, 6)
    ext = (4, 4) if uniform else (4, 3)
    lengths = (prefixes[0] + ext[0], prefixes[1] + ext[1], prefixes[2] + 1)
    d = Driver(op, lengths, page_size=5)
    d.step([(0, prefixes[0]), (1, prefixes[1]), (2, prefixes[2])])
    state, spec = d.caches["state"], d.caches["spec"]
    before = state.clone()
    segs = [(0, ext[0], SEG_EXTEND), (1, ext[1], SEG_EXTEND)]
    if not uniform:
        segs.append((2, 1, SEG_NORMAL))  # a plain decode in the same call
    outs = d.step(segs)
    for i in (0, 1):
        slot = d.slots[i]
        assert torch.equal(state[slot], before[slot]), "EXTEND touched the main state"
        xs = d.inputs[i]
        y_ref, _ = op.ref(xs)
        close(outs[i], y_ref[:, prefixes[i]:])
        for j in range(ext[i]):
            _, s_ref = op.ref([x[:, :prefixes[i] + j + 1] for x in xs])
            close(spec[slot, j], s_ref[0])
        assert torch.isnan(spec[slot, ext[i]:]).all(), "entries past the segment were written"
    if not uniform:  # the NORMAL decode advanced its own slot
        _, s_ref = op.ref(d.inputs[2])
        close(state[d.slots[2]], s_ref[0].to(state.dtype))


@pytest.mark.parametrize("case", RECURRENT)
def test_extend_without_spec_state_fails(case):
    op = CASES[case]()
    d = Driver(op, [6], page_size=5)
    d.step([(0, 3)])
    d.caches.pop("spec")
    with pytest.raises(RuntimeError, match="spec-state"):
        d.step([(0, 2, SEG_EXTEND)])


@pytest.mark.parametrize("case", RECURRENT)
def test_extend_longer_than_spec_state_fails(case):
    d = Driver(CASES[case](), [12], page_size=5)  # spec state holds 5 tokens
    d.step([(0, 3)])
    with pytest.raises(RuntimeError, match="max draft tokens"):
        d.step([(0, 6, SEG_EXTEND)])


def test_state_slot_holds_final_state(close):
    """After NORMAL segments the slot holds the ref's final state (a later chunk starts there)."""
    for name in RECURRENT:
        op = CASES[name]()
        d = Driver(op, [23], page_size=5)
        _schedule_chunks(d, 0, (10, 13))
        _, s_ref = op.ref(d.inputs[0])
        close(d.caches["state"][d.slots[0]], s_ref[0])


@pytest.mark.parametrize("case", RECURRENT)
def test_in_place_decode_step_is_the_general_path(case, monkeypatch):
    """A step of decodes only updates the state slots in place (`run_cached`'s `step`): outputs
    and states bit for bit those of the general path (gather the slots, the core's one-token
    form, scatter), slots outside the batch untouched (their NaN stays), and the in-place step
    is what ran at every decode step (counted), not the general path."""
    import specdeploy.ops.cached_recurrent as cr

    original, taken = cr.run_cached, []

    def counting(*args, step=None):
        def counted(xs, state, slots):
            y = step(xs, state, slots)
            taken.append(y is not None)
            return y
        return original(*args, step=None if step is None else counted)

    def general(*args, step=None):
        return original(*args, step=None)

    runs = {}
    for name, fn in (("in_place", counting), ("general", general)):
        monkeypatch.setattr(cr, "run_cached", fn)
        torch.manual_seed(7)  # the case's weights
        d = Driver(CASES[case](), [15, 13, 16], page_size=5, slots=(4, 0, 2), seed=7)
        d.step([(0, 6), (1, 4), (2, 7)])
        outs = [d.step([(2, 1), (0, 1), (1, 1)]) for _ in range(6)]
        runs[name] = (outs, d.caches["state"].clone())
    assert taken == [True] * 6
    (outs_a, state_a), (outs_b, state_b) = runs["in_place"], runs["general"]
    for a, b in zip(outs_a, outs_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(state_a[[4, 0, 2]], state_b[[4, 0, 2]])
    assert torch.isnan(state_a[[1, 3, 5]]).all()
