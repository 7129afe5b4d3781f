"""Bucket padding of decode / verify steps (cache/padding.py), the CPU-testable half of CUDA-graph
replay: the real rows' logits are bit-identical padded and unpadded, and the dummy rows write
only the plan's scratch page and slot (every real KV page and recurrent state is as unpadded)."""
from __future__ import annotations

import random

import pytest
import torch

from specdeploy.cache.handlers import PagedKV
from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.cache.padding import bucket_of, buckets_for, pad_batch, uniform_step
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.models import llama
from tests.spec.tiny_targets import METHODS, Target

K = 3


@pytest.fixture(scope="module", params=sorted(METHODS))
def deployed(request, tmp_path_factory):
    target = Target(request.param, tmp_path_factory.mktemp("pad"))
    return build(str(target.path), dtype="float32", max_batch_size=8, max_seq_len=128,
                 max_cache_gib=0.05, spec=target.spec(K))


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    """A deployment whose kernels are batch-invariant (GGUF blocks on the integer-dot kernels,
    attention row by row): there padding must not move a single bit."""
    from specdeploy.ops import ggml_int
    from specdeploy.ops.ggml_linear import kernel_unavailable
    from tests.checkpoint.test_gguf import Q, _tiny_llama_gguf

    why = kernel_unavailable() or ggml_int.kernel_unavailable()
    if why:
        pytest.skip(f"ggml kernels unavailable: {why}")
    d = tmp_path_factory.mktemp("pad_gguf")
    path = _tiny_llama_gguf(llama.make_tiny(d / "st", seed=7), d / "tiny.gguf", Q.Q4_1)
    return build(str(path), kernels="fast", max_batch_size=8, max_seq_len=64, page_size=4,
                 max_cache_gib=0.01, spec=SpecConfig("ngram", K))


def _cache_buffers(dep) -> dict[str, tuple[torch.Tensor, int]]:
    """Each cache buffer of the target program and the index (dim 0) of its scratch entry."""
    dep, out = dep.target, {}
    for h in dep.resources:
        if isinstance(h, PagedKV):
            for side in ("k", "v"):
                out[f"{h.name}_{side}"] = (getattr(dep.gm, f"{h.name}_{side}"),
                                           dep.plan.scratch_page)
        elif h.kind in ("state", "spec_state"):
            out[h.name] = (getattr(dep.gm, h.name), dep.plan.scratch_slot)
    return out


def _prefill(dep, rng: random.Random, n: int):
    """n sequences of random lengths in random slots, each with its own pages."""
    ps, num_pages = dep.layout.page_size, dep.layout.num_pages
    slots = rng.sample(range(dep.layout.num_slots), n)
    seqs, next_page = [], 0
    for slot in slots:
        length = rng.randint(1, 40)
        need = -(-(length + K + 1) // ps)
        pages = list(range(next_page, next_page + need))
        next_page += need
        assert next_page <= num_pages
        ids = [rng.randint(3, 99) for _ in range(length)]
        dep.forward(build_metadata([Segment(ids, 0, pages, slot)]))
        seqs.append((length, pages, slot))
    return seqs


def _step(dep, meta, bufs, before):
    for name, (buf, _) in bufs.items():
        buf.copy_(before[name])
    logits = dep.forward(meta).logits
    return logits, {name: buf.clone() for name, (buf, _) in bufs.items()}


def _check_padding(dep, kind: str, exact: bool, trials: int = 4):
    """Random decode / verify batches, unpadded and padded (to their bucket, or the largest),
    from the same cache contents. Real rows' logits: bit-identical where the kernels are
    batch-invariant (`exact`), else within fp32 rounding (the CPU's fp32 linears pick their
    algorithm by row count, see deploy/passes/pack_linears.py: bits move by ~1e-7 there, with
    or without padding). Every cache entry outside the scratch page / slot: bit-identical to
    the unpadded step's where that step left it unchanged (no dummy write lands there), and
    equal (exact) or within rounding where a real row wrote it."""
    bufs = _cache_buffers(dep)
    assert any(n.endswith("_k") for n in bufs)
    rng = random.Random(0 if kind == "decode" else 1)
    buckets = buckets_for(dep.layout.num_slots)
    for trial in range(trials):
        n = rng.randint(1, dep.layout.num_slots - 1)
        seqs = _prefill(dep, rng, n)
        before = {name: buf.clone() for name, (buf, _) in bufs.items()}
        for name, (_, scratch) in bufs.items():  # garbage there must not reach a real row
            before[name][scratch] = 0.5
        width = 1 if kind == "decode" else K + 1
        segs = [Segment([rng.randint(3, 99) for _ in range(width)], length, pages, slot,
                        width, SEG_NORMAL if kind == "decode" else SEG_EXTEND)
                for length, pages, slot in seqs]
        meta = build_metadata(segs)
        assert uniform_step(meta) == (width, width)
        bucket = bucket_of(n, buckets) if trial % 2 else dep.layout.num_slots
        plan = dep.target.plan
        padded = pad_batch(meta, bucket, scratch_page=plan.scratch_page,
                           scratch_slot=plan.scratch_slot, page_size=plan.page_size)
        assert padded.num_seqs == bucket and padded.num_tokens == bucket * width
        plain, after_plain = _step(dep, meta, bufs, before)
        pad, after_pad = _step(dep, padded, bufs, before)
        assert pad.shape[0] == bucket * width
        _same(pad[:plain.shape[0]], plain, exact, f"{kind} logits, {n} rows in {bucket}")
        assert torch.equal(pad[:plain.shape[0]].argmax(-1), plain.argmax(-1))
        touched = False
        for name, (_, scratch) in bufs.items():
            keep = torch.ones(after_pad[name].shape[0], dtype=torch.bool)
            keep[scratch] = False
            got, want = after_pad[name][keep], after_plain[name][keep]
            untouched = (want == before[name][keep])
            assert torch.equal(got[untouched], want[untouched]), name
            _same(got[~untouched], want[~untouched], exact, name)
            touched |= not torch.equal(after_pad[name][scratch], after_plain[name][scratch])
        assert touched or bucket == n  # the dummy rows wrote somewhere: the scratch


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got, want), what
    else:
        scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)
        assert ((got - want).abs().max().item() if want.numel() else 0.0) <= 1e-5 * scale, what


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_padded_rows_leave_real_rows_alone(deployed, kind):
    _check_padding(deployed, kind, exact=False)


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_padding_is_bit_exact_on_batch_invariant_kernels(invariant, kind):
    _check_padding(invariant, kind, exact=True)


def test_buckets():
    assert buckets_for(6) == (1, 2, 4, 6)
    assert buckets_for(16) == (1, 2, 4, 8, 16)
    assert buckets_for(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_of(3, (1, 2, 4, 8)) == 4 and bucket_of(9, (1, 2, 4, 8)) is None


def test_pad_refuses_ragged_steps():
    meta = build_metadata([Segment([1, 2], 0, [0], 0, 2), Segment([3], 4, [1], 1)])
    assert uniform_step(meta) is None
    with pytest.raises(ValueError, match="pad_batch"):
        pad_batch(meta, 4, scratch_page=9, scratch_slot=3, page_size=16)
    one = build_metadata([Segment([1], 3, [0], 0)])
    assert pad_batch(one, 1, scratch_page=9, scratch_slot=3, page_size=16) is one
    with pytest.raises(ValueError, match="smaller"):
        pad_batch(build_metadata([Segment([1], 3, [0], 0)] * 2), 1, scratch_page=9,
                  scratch_slot=3, page_size=16)


def test_padded_metadata_points_at_the_scratch():
    meta = build_metadata([Segment([5, 6], 7, [2, 3], 1, 2, SEG_EXTEND)])
    p = pad_batch(meta, 3, scratch_page=9, scratch_slot=4, page_size=4)
    assert p.slot_idx.tolist() == [1, 4, 4] and p.seg_kind.tolist() == [SEG_EXTEND] * 3
    assert p.page_table.tolist() == [[2, 3], [9, 9], [9, 9]]
    assert p.cache_lens.tolist() == [7, 1, 1] and p.position_ids.tolist() == [7, 8, 1, 2, 1, 2]
    assert p.cu_seqlens.tolist() == [0, 2, 4, 6] and p.logits_idx.tolist() == [0, 1, 2, 3, 4, 5]
