"""One copy of the weights and a cache sized to need (issue 21).

Oracles: gguf's own dequantization (the reader's fp32 tensors), the previous fp32 path of
prefill rows (`pack_linears.packed_linear_fn` over those fp32 weights: oneDNN-packed where it
packed, else F.linear), a deployment of the same file loaded without deferral (the plain model's
fp32 parameters present), and byte counts of what the graph holds.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.handlers import PagedKV, lazy_zeros
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.deploy.deferred import materialize_deferred
from specdeploy.deploy.memory import process_memory
from specdeploy.deploy.passes.ggml_linears import MAX_ROWS, dequant_linear
from specdeploy.deploy.passes.pack_linears import packed_linear_fn
from specdeploy.loading import load_model
from specdeploy.ops.ggml_linear import dequantize, ggml_embedding, kernel_unavailable, make_weight
from tests.deploy.test_ggml_linears import LIMITS, tiny_gguf  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")


def _blocks(kind: str, n: int, k: int, seed: int = 0):
    """Random weights quantized by gguf: (GGMLWeight, gguf's fp32 dequantization)."""
    import gguf

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    qt = getattr(gguf.GGMLQuantizationType, kind.upper())
    raw = gguf.quants.quantize(w, qt)
    return (make_weight(kind, torch.from_numpy(raw), (n, k)),
            torch.from_numpy(gguf.quants.dequantize(raw, qt).astype("float32")))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
def test_dequantize_and_gather_are_ggufs_values_bit_for_bit(kind):
    gw, want = _blocks(kind, 40, 96)
    assert torch.equal(dequantize(gw), want)
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(ggml_embedding(ids, gw), want[ids])  # few ids: the host path
    many = torch.arange(65).reshape(5, 13) % 40  # the tensor path
    assert torch.equal(ggml_embedding(many, gw), want[many])
    with pytest.raises(IndexError, match="rows outside"):
        ggml_embedding(torch.tensor([1, 40]), gw)
    buf = torch.empty(40 * 96 + 7)
    assert torch.equal(dequantize(gw, out=buf), want)  # into a reused, larger buffer
    with pytest.raises(IndexError, match="rows outside"):
        dequantize(gw, torch.tensor([40]))


@pytest.mark.parametrize("n,k", [(1536, 576), (64, 96)], ids=["packed", "plain"])
@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 64])
def test_prefill_rows_equal_the_previous_fp32_path(n, k, rows):
    """Above MAX_ROWS the one-copy path (dequantize, then the GEMM) gives the bits of the fp32
    path it replaces (packed where the weight is large enough to pack, else F.linear)."""
    gw, w = _blocks("q4_1", n, k, seed=1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    b = torch.randn(n)
    assert torch.equal(dequant_linear(x, gw, b), packed_linear_fn(w, b, pack=True)(x))


def _fp32_bytes_of_blocks(dep) -> int:
    """fp32 bytes the graph holds for 2-D weights (the block-quantized linears and the
    embedding are the only 2-D tensors of the tiny llama)."""
    seen = {}
    for name, t in (*dep.gm.named_parameters(), *dep.gm.named_buffers()):
        if t.dim() == 2 and t.dtype == torch.float32 and "kv_cache" not in name:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_no_fp32_copy_of_block_weights_stays_and_outputs_are_unchanged(tiny_gguf):  # noqa: F811
    """The default build (deferred load) holds no fp32 copy of the blocks' weights, and its
    logits equal, bit for bit, those of a build from the fully loaded model (fp32 parameters
    present): prefill above MAX_ROWS rows, then decode rows."""
    _, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    ref = build(model=load_model(path), **LIMITS)
    assert _fp32_bytes_of_blocks(dep) == 0 and _fp32_bytes_of_blocks(ref) == 0
    w = dep.weight_bytes()
    blocks = sum(g.blocks.nbytes for g in load_model(path).ggml_weights.values())
    assert w.closures == blocks  # exactly one copy of the blocks (fused groups: views)
    assert "weights resident" in dep.report()
    ids = list(range(3, 3 + MAX_ROWS + 9))
    pages = list(range(16))
    for d in (dep, ref):
        d.out = [d.forward(build_metadata([Segment(ids, 0, pages, 0, len(ids))])).logits]
        for pos in range(len(ids), len(ids) + 3):
            d.out.append(d.forward(build_metadata([Segment([7], pos, pages, 0, 1)])).logits)
    for a, b in zip(dep.out, ref.out):
        assert torch.equal(a, b)


def test_a_weight_left_on_the_fp32_path_is_filled_from_its_blocks(tiny_gguf):  # noqa: F811
    """ggml_linears disabled: nothing is deferred, and the logits are the plain model's; a
    deferred model whose placeholders are filled from the blocks is the plain model bit for
    bit."""
    _, path = tiny_gguf
    dep = build(str(path), disabled=frozenset({"ggml_linears"}), **LIMITS)
    ids = list(range(5, 25))
    with torch.no_grad():
        want = load_model(path)(torch.tensor([ids]))[0]
    got = dep.forward(build_metadata([Segment(ids, 0, list(range(16)), 0, len(ids))])).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # deferred: placeholders read as zeros until filled; filled, the model is the plain one
    lazy = load_model(path, defer_blocks=True)
    assert lazy.ggml_deferred and all(not t.any() for t in lazy.ggml_deferred.values())
    assert materialize_deferred(lazy, lazy) > 0 and not lazy.ggml_deferred
    with torch.no_grad():
        assert torch.equal(lazy(torch.tensor([ids]))[0], want)


def test_kv_dtype_follows_the_kernels(tiny_gguf):  # noqa: F811
    _, path = tiny_gguf
    kv = {k: [h.dtype for h in build(str(path), kernels=k, **LIMITS).resources
              if isinstance(h, PagedKV)] for k in ("exact", "fast")}
    assert set(kv["exact"]) == {torch.float32} and set(kv["fast"]) == {torch.bfloat16}
    half = build(str(path), kv_cache_dtype="float16", **LIMITS)
    assert {b.dtype for n, b in half.gm.named_buffers() if "kv_cache" in n} == {torch.float16}
    with pytest.raises(ValueError, match="kv_cache_dtype: one of"):
        build(str(path), kv_cache_dtype="fp4", **LIMITS)


def test_cache_is_sized_by_batch_and_length_and_backed_as_written(tiny_gguf):  # noqa: F811
    _, path = tiny_gguf
    small = build(str(path), max_batch_size=2, max_seq_len=32, page_size=4)
    big = build(str(path), max_batch_size=4, max_seq_len=64, page_size=4)
    assert (small.layout.num_pages, big.layout.num_pages) == (2 * 8 + 1, 4 * 16 + 1)
    capped = build(str(path), max_batch_size=4, max_seq_len=64, page_size=4,
                   max_cache_gib=big.layout.total_bytes / 2 / 2**30)
    assert capped.layout.total_bytes <= big.layout.total_bytes / 2
    # 256 MiB reserved costs no resident memory until written; one page written costs a page
    before = process_memory().get("rss")
    if before is None:
        pytest.skip("no /proc/self/status")
    t = lazy_zeros((256, 1 << 18), torch.float32, "cpu")
    assert process_memory()["rss"] - before < 16 << 20 and t[100].abs().sum() == 0
    t[3].fill_(1.0)
    assert process_memory()["rss"] - before < 32 << 20 and t[3].sum() == 1 << 18
