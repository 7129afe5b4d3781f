"""F16 / BF16 GGUF matrices read as stored by the exact kernel (ops/ggml_kernels.c `half8`):
a full-precision GGUF's linears at half the bytes of fp32 copies, computing the fp32 model.

Oracles: gguf-py's dequantization (the kernel's values equal it bit for bit: fp16 / bf16 widen
to fp32 exactly), a float64 matmul over those values (the kernel within fp32 round-off), and the
fp32 model read from the same file (a deployment's logits within 1e-5, "exact" and "fast": the
latter runs these kinds on the exact kernel at every row count, as MXFP4 where nothing tiled
reads it).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl
from tests.ops.test_ggml_int import _x

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
HALF = {"f16": Q.F16, "bf16": Q.BF16}

pytestmark = pytest.mark.skipif(gl.kernel_unavailable() is not None,
                                reason=f"GGUF kernel unavailable: {gl.kernel_unavailable()}")


def _raw(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return np.ascontiguousarray(gguf.quants.quantize(w, HALF[kind])).view(np.uint8).reshape(n, -1)


@pytest.mark.parametrize("kind", list(HALF))
def test_dequantize_is_gguf_py_bit_for_bit(kind):
    n, k = 6, 64
    raw = _raw(kind, n, k, seed=1)
    bits = raw.view(np.uint16)
    specials = [0x0001, 0x8001, 0x7C00, 0xFC00, 0x7BFF, 0x0400] if kind == "f16" else [
        0x0001, 0x8001, 0x7F80, 0xFF80, 0x7F7F, 0x0080]
    bits[0, :len(specials)] = specials
    want = gguf.quants.dequantize(raw, HALF[kind]).reshape(n, k).astype(np.float32)
    w = gl.make_weight(kind, torch.from_numpy(raw), (n, k))
    assert np.array_equal(gl.dequantize(w).numpy().view(np.uint32), want.view(np.uint32))
    assert np.isinf(want).sum() == 2
    rows = torch.tensor([3, 0, 5])
    assert torch.equal(gl.dequantize(w, rows), torch.from_numpy(want[rows.numpy()]))
    bits[1, 7] = 0x7E00 if kind == "f16" else 0x7FC0  # NaN
    assert torch.isnan(gl.dequantize(gl.make_weight(kind, torch.from_numpy(raw), (n, k)))[1, 7])
    assert gl.nonfinite_values(w)
    assert not gl.nonfinite_values(gl.make_weight(kind, torch.from_numpy(_raw(kind, n, k, 2)),
                                                  (n, k)))


@pytest.mark.parametrize("kind", list(HALF))
def test_exact_kernel_is_the_fp32_model_and_batch_invariant(kind):
    """Within fp32 round-off (8 lanes of K / 8 fmas, then the lane sum) of a float64 matmul; a
    row the same bits alone, in any batch, at 1 and 2 threads."""
    for n, k in [(1, 32), (37, 96), (64, 576)]:
        raw = _raw(kind, n, k, seed=n)
        values = gguf.quants.dequantize(raw, HALF[kind]).reshape(n, k).astype(np.float64)
        w = gl.make_weight(kind, torch.from_numpy(raw), (n, k))
        x = _x(9, k, seed=k)
        y = gl.ggml_linear(x, w)
        xd = x.double().numpy()
        bound = (k / 8 + 4) * 2.0**-24 * (np.abs(xd) @ np.abs(values).T)
        assert (np.abs(y.double().numpy() - xd @ values.T) <= bound).all()
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(gl.ggml_linear(x, w), y)
                assert torch.equal(torch.cat([gl.ggml_linear(x[i:i + 1], w) for i in range(9)]),
                                   y)
                assert torch.equal(gl.ggml_linear(x[:5], w), y[:5])
        finally:
            torch.set_num_threads(before)


def test_non_finite_weight_is_refused(tmp_path):
    from specdeploy.checkpoint.errors import CheckpointError
    from specdeploy.loading import _defer_blocks

    raw = _raw("bf16", 16, 64, seed=3)
    raw.view(np.uint16)[4, 9] = 0xFF80  # -inf
    w = gl.make_weight("bf16", torch.from_numpy(raw), (16, 64))
    model = torch.nn.Linear(64, 16, bias=False)
    with pytest.raises(CheckpointError, match="'weight' has non-finite"):
        _defer_blocks(model, {"weight": w}, {"weight": torch.zeros(16, 64)}, tmp_path)


@pytest.fixture(scope="module", params=list(HALF))
def half_gguf(request, tmp_path_factory):
    """A tiny Llama (hidden 64, MLP 160: rows in 32s) as a GGUF with F16 / BF16 matrices."""
    from specdeploy.models import llama
    from tests.checkpoint.test_gguf import _tiny_llama_gguf

    d = tmp_path_factory.mktemp("half")
    src = llama.make_tiny(d / "st", seed=3)
    return _tiny_llama_gguf(src, d / "half.gguf", qtype=HALF[request.param]), request.param


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_gguf_deploys_on_half_blocks(half_gguf, kernels):
    """Every matrix (embedding and LM head too) keeps its F16 / BF16 bytes, no fp32 linear is
    left in the graph, and a prefill, a 4-row chunk and a decode step's logits equal the fp32
    model's (read from the same file) within 1e-5 of their scale."""
    from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.loading import load_model
    from tests.ops.gguf_deploy_blocks import assert_close

    path, kind = half_gguf
    model = load_model(path)
    assert {w.kind for w in model.ggml_weights.values()} == {kind}
    assert len(model.ggml_weights) >= 2 * 7 + 2, sorted(model.ggml_weights)
    dep = build(str(path), kernels=kernels, kv_cache_dtype="float32", max_batch_size=2,
                max_seq_len=64, page_size=4, max_cache_gib=0.02)
    assert not [n for n in dep.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert {i.name: i for i in dep.infos}["ggml_linears"].num_matches >= 2 * 7
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids)[0]
    pos, pages = 0, list(range(16))
    for n in (21, 4, 1):
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, SEG_NORMAL)
        assert_close(dep.forward(build_metadata([seg])).logits, want[pos:pos + n], rtol=1e-5)
        pos += n
