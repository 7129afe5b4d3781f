"""fuse_rope_attention: one qkv_attention op per Llama-type layer, giving the unfused chain's bits
(oracle: the chain itself, `qkv_attention_ref`, and the graph built without the pass)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models.registry import family_module
from specdeploy.ops import attention_rows, row_kernels
from specdeploy.ops.qkv_attention import qkv_attention_ref

pytestmark = pytest.mark.skipif(
    attention_rows.unavailable() is not None or row_kernels._library() is None,
    reason=f"C kernels unavailable here: {attention_rows.unavailable()}")
LIMITS = dict(max_batch_size=3, max_seq_len=64, page_size=4, max_cache_gib=0.01)


def _count(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and name in getattr(n.target, "__name__", str(n.target)))


def _steps():
    """Prefill chunks (one of 21 rows), then decodes of 3 sequences, then a
    verify-like step (extend segments of 1-4 rows) beside a decode."""
    a, b, c = list(range(5, 26)), list(range(30, 37)), list(range(40, 43))
    pages = {0: list(range(0, 8)), 1: list(range(8, 16)), 2: list(range(16, 24))}
    yield [Segment(a, 0, pages[0], 0, num_logits=len(a)), Segment(b, 0, pages[1], 1)]
    yield [Segment(c, 0, pages[2], 2, num_logits=3)]
    lens = {0: len(a), 1: len(b), 2: len(c)}
    for step in range(3):
        yield [Segment([50 + step + s], lens[s] + step, pages[s], s) for s in range(3)]
    for s in range(3):
        lens[s] += 3
    yield [Segment([60, 61, 62, 63], lens[0], pages[0], 0, num_logits=4, kind=SEG_EXTEND),
           Segment([64], lens[1], pages[1], 1),
           Segment([65, 66], lens[2], pages[2], 2, num_logits=2, kind=SEG_EXTEND)]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_fused_graph_gives_the_unfused_bits(tmp_path, kv_dtype):
    family_module("llama").make_tiny(tmp_path, seed=0)
    fused = build(str(tmp_path), kv_cache_dtype=kv_dtype, **LIMITS)
    info = {i.name: i for i in fused.infos}["fuse_rope_attention"]
    assert info.num_matches == 2  # both layers of the tiny llama
    assert _count(fused.gm, "qkv_attention") == 2 and _count(fused.gm, "cached_attention") == 0
    assert _count(fused.gm, "rope") == 0
    base = build(model=load_model(str(tmp_path)), kv_cache_dtype=kv_dtype,
                 disabled=frozenset({"fuse_rope_attention"}), **LIMITS)
    assert _count(base.gm, "cached_attention") == 2
    for segs in _steps():
        meta = build_metadata(segs)
        got, want = fused.forward(meta).logits, base.forward(meta).logits
        assert torch.equal(got, want), (segs, (got - want).abs().max())


def _caches(dtype, g, pages=24, ps=4, hkv=2, d=16):
    k = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    return k, torch.randn(pages, ps, hkv, d, generator=g).to(dtype)


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens_rows", [((5,), (1,)), ((3, 9, 0), (1, 1, 1)),
                                       ((6, 2, 10), (4, 1, 3)), ((7,), (20,)),
                                       ((6, 30, 40), (4, 70, 3))])
def test_op_equals_the_chain(dtype, lens_rows, rope, monkeypatch):
    """The C path (decode, verify and a 20-row prefill chunk alike): outputs and both caches
    bit-equal to the chain; partial rotary (12 of 16 dims) or none (cos, sin None: the q and k
    heads as projected, NemotronH); GQA 4 q heads on 2. The last case
    has a 70-row segment between a verify and a decode: the kernel's passes of 64 rows cut it
    (and the step) where the chain attends it whole, and keys span several chunks of 32."""
    g = torch.Generator().manual_seed(sum(lens_rows[0]) + len(lens_rows[1]))
    lens, rows = lens_rows
    hq, hkv, d, ps = 4, 2, 16, 4
    t = sum(rows)
    qkv = torch.randn(1, t, (hq + 2 * hkv) * d, generator=g)
    pos = [n + i for n, r in zip(lens, rows) for i in range(r)]
    cos = torch.randn(1, t, 12, generator=g) if rope else None
    sin = torch.randn(1, t, 12, generator=g) if rope else None
    # each sequence its own 8 pages, not in order (page_table.flip: the paged reads are tested)
    npp = max(8, -(-max(n + r for n, r in zip(lens, rows)) // ps))  # pages per sequence
    page_table = torch.arange(npp * len(lens)).view(len(lens), npp).flip(1).contiguous()
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(rows))
    p = torch.tensor(pos)
    slots = page_table[seg, p // ps] * ps + p % ps
    lens_t = torch.tensor(lens)
    k1, v1 = _caches(dtype, g, pages=max(24, npp * len(lens)))
    k2, v2 = k1.clone(), v1.clone()
    args = (cu, cu, lens_t, lens_t, page_table, 0.25, 0, slots, hq, hkv, d)
    calls = []
    real = attention_rows.write_attend_rows
    monkeypatch.setattr(attention_rows, "write_attend_rows",
                        lambda *a: calls.append(1) or real(*a))
    got = torch.ops.specdeploy.qkv_attention(qkv, cos, sin, k1, v1, *args)
    assert len(calls) == 1  # the C path for every segment length (prefill chunks too)
    # the chain as it ran before its one-call path: slots from the lengths (slot_mapping None),
    # the cache writes in torch, each sequence's rows by `_rows`
    want = qkv_attention_ref(qkv, cos, sin, k2, v2, *args[:7], None, *args[8:])
    assert torch.equal(got, want)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_attention_without_rope_fuses_and_gives_the_unfused_bits(tmp_path, kv_dtype):
    """NemotronH's attention layers (no RoPE) become qkv_attention ops without cos / sin."""
    family_module("nemotron_h").make_tiny(tmp_path, seed=0)
    spec = {"method": "ngram", "num_speculative_tokens": 3}  # the verify step's spec states
    fused = build(str(tmp_path), kv_cache_dtype=kv_dtype, spec=spec, **LIMITS)
    n = {i.name: i for i in fused.target.infos}["fuse_rope_attention"].num_matches
    base = build(model=load_model(str(tmp_path)), kv_cache_dtype=kv_dtype, spec=spec,
                 disabled=frozenset({"fuse_rope_attention"}), **LIMITS)
    fused, base = fused.target, base.target
    assert n >= 1 and _count(base.gm, "cached_attention") == n
    assert _count(fused.gm, "qkv_attention") == n and _count(fused.gm, "cached_attention") == 0
    for segs in _steps():
        meta = build_metadata(segs)
        got, want = fused.forward(meta).logits, base.forward(meta).logits
        assert torch.equal(got, want), (segs, (got - want).abs().max())


def test_flatten_attrs_reads_the_same_tensors(tmp_path):
    """flatten_attrs: no dotted get_attr is left, the outputs equal the graph built without it,
    and the flat attributes are the registered tensors themselves (an in-place update through
    the module path is what the graph reads)."""
    family_module("llama").make_tiny(tmp_path, seed=1)
    flat = build(str(tmp_path), **LIMITS)
    info = {i.name: i for i in flat.infos}["flatten_attrs"]
    assert info.num_matches > 0
    assert not [n for n in flat.gm.graph.nodes if n.op == "get_attr" and "." in n.target]
    base = build(model=load_model(str(tmp_path)), disabled=frozenset({"flatten_attrs"}), **LIMITS)
    assert [n for n in base.gm.graph.nodes if n.op == "get_attr" and "." in n.target]
    meta = lambda: build_metadata([Segment(list(range(5, 14)), 0, list(range(4)), 0)])  # noqa: E731
    assert torch.equal(flat.forward(meta()).logits, base.forward(meta()).logits)
    for node in flat.gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("_flat_"):
            registered = dict(flat.gm.named_parameters(remove_duplicate=False))
            registered.update(dict(flat.gm.named_buffers(remove_duplicate=False)))
            assert any(t is getattr(flat.gm, node.target) for t in registered.values())
            break
