"""ops/ggml_moe_int.py: a MoE layer's routed experts on GGUF blocks in one C call.

Oracles: the same layer composed in Python from ggml_linear_int calls (tests/ops/test_ggml_int.py
checks those against exact math), row_kernels' silu_mul or relu(h)^2, and each token's sum in
expert order: bit for bit. Then every ISA path, every thread count and every token alone against
the batch: the same bits (a verify step's rows equal the decode rows they replay).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_int, row_kernels
from specdeploy.ops import ggml_moe_int as gm
from specdeploy.ops.ggml_linear import expert, make_weight

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, random_kquant  # noqa: E402

pytestmark = pytest.mark.skipif(gm.unavailable() is not None,
                                reason=f"one-call MoE kernel unavailable: {gm.unavailable()}")
QT = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K,
      "q6_k": Q.Q6_K}
E, K_TOP = 6, 3


def _stacked(kind: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    if kind.endswith("_k"):
        raw = random_kquant(QT[kind], (E, n, k), rng)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((E, n, k)) * 0.1).astype(np.float32),
                                   QT[kind])
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(E, n, -1).copy())
    return make_weight(kind, blocks, (E, n, k))


def _layer(kinds, activation, h=256, inter=256):
    up = _stacked(kinds[0], inter * (2 if activation == "swiglu" else 1), h, 1)
    down = _stacked(kinds[1], h, inter, 2)
    return up, down


def _inputs(tokens: int, h: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, K_TOP, generator=g)


def _composed(x, ids, wts, up, down, activation, isa):
    """The layer from ggml_linear_int calls, one (token, expert) pair at a time."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            hu = ggml_int.ggml_linear_int(x[t:t + 1], expert(up, e), isa=isa)
            if activation == "swiglu":
                a = row_kernels.silu_mul(hu, inter)
            else:
                a = torch.relu(hu).square()
            y = ggml_int.ggml_linear_int(a, expert(down, e), isa=isa)
            out[t] = out[t] + y[0] * wts[t, j]
    return out


@pytest.mark.parametrize("kinds", [("q4_0", "q4_0"), ("q8_0", "q4_1"), ("q4_k", "q6_k"),
                                   ("q5_k", "q5_k")])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_one_call_equals_the_composed_layer_bit_for_bit(kinds, activation):
    up, down = _layer(kinds, activation)
    # 24 tokens x 3 of 6 experts: ~12 rows an expert (the many-row K-quant tiles on AVX2 and
    # AVX-512 alike)
    x, ids, wts = _inputs(24, 256, seed=len(kinds[0]))
    isa = ggml_int.default_isa()
    got = gm.bound_experts(up, down, activation, isa, tiled=False)(x, ids, wts)
    assert torch.equal(got, _composed(x, ids, wts, up, down, activation, isa))


@pytest.mark.parametrize("kinds", [("q4_1", "q8_0"), ("q4_k", "q6_k")])
def test_isa_thread_and_batch_invariant(kinds):
    up, down = _layer(kinds, "swiglu")
    x, ids, wts = _inputs(20, 256, seed=3)
    threads = torch.get_num_threads()
    ys = {}
    try:
        for isa in ggml_int.supported_isas():
            fn = gm.bound_experts(up, down, "swiglu", isa, tiled=False)
            for n in (1, 2):
                torch.set_num_threads(n)
                ys[(isa, n)] = fn(x, ids, wts)
    finally:
        torch.set_num_threads(threads)
    first = next(iter(ys.values()))
    for key, y in ys.items():
        assert torch.equal(y, first), key
    fn = gm.bound_experts(up, down, "swiglu", ggml_int.default_isa(), tiled=False)
    for t in range(x.shape[0]):  # each token alone: its row of the batch
        assert torch.equal(fn(x[t:t + 1], ids[t:t + 1], wts[t:t + 1])[0], first[t]), t
    # and in another order with other tokens beside it
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(5))
    assert torch.equal(fn(x[perm], ids[perm], wts[perm]), first[perm])


def test_bad_input_is_named():
    up, down = _layer(("q4_0", "q4_0"), "swiglu")
    fn = gm.bound_experts(up, down, "swiglu", ggml_int.default_isa())
    x, ids, wts = _inputs(2, 256)
    with pytest.raises(ValueError, match="expert ids"):
        fn(x, torch.full_like(ids, E), wts)
    with pytest.raises(ValueError, match="x must be"):
        fn(x[:, :128], ids, wts)
    with pytest.raises(ValueError, match="activation"):
        gm.bound_experts(up, down, "gelu", "scalar")
    with pytest.raises(ValueError, match="do not fit"):
        gm.bound_experts(up, down, "relu2", "scalar")
    assert fn(x[:0], ids[:0], wts[:0]).shape == (0, 256)


def test_a_change_to_an_included_file_rebuilds(tmp_path, monkeypatch):
    """ggml_moe_int.c #includes ggml_kernels_int.c: the cached library's name hashes both."""
    from specdeploy.ops import ggml_linear as gl

    monkeypatch.setattr(gl, "_cache_dir", lambda: tmp_path / "cache")
    (tmp_path / "inner.c").write_text("int seven(void) { return 7; }\n")
    outer = tmp_path / "outer.c"
    outer.write_text('#include "inner.c"\nint twice(void) { return 2 * seven(); }\n')
    sig = {"twice": ([], __import__("ctypes").c_int)}
    flags = ["-O1", "-shared", "-fPIC"]
    lib, errors = gl.load_compiled("outer", outer, flags, sig, libs=())
    if lib is None:
        pytest.skip(f"no C compiler: {errors}")
    assert lib.twice() == 14
    (tmp_path / "inner.c").write_text("int seven(void) { return 8; }\n")
    assert gl.load_compiled("outer", outer, flags, sig, libs=())[0].twice() == 16


def _composed_tiled(x, ids, wts, up, down, activation):
    """The layer from ggml_tiled calls over each expert's tiled copy, a pair at a time."""
    from specdeploy.ops import ggml_tiled

    out = torch.zeros_like(x)
    inter, isa = down.shape[2], ggml_int.default_isa()
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            hu = ggml_tiled.tiled_linear(x[t:t + 1], ggml_tiled.repack(expert(up, e)), None, isa)
            a = row_kernels.silu_mul(hu, inter) if activation == "swiglu" else \
                torch.relu(hu).square()
            y = ggml_tiled.tiled_linear(a, ggml_tiled.repack(expert(down, e)), None, isa)
            out[t] = out[t] + y[0] * wts[t, j]
    return out


@pytest.mark.parametrize("kinds", [("q4_0", "q4_0"), ("q8_0", "q4_1")])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_tiled_experts_equal_the_composed_tiled_layer(kinds, activation):
    """Q4_0 / Q4_1 / Q8_0 experts run on tiled copies by default: the same bits as the layer
    composed from tiled_linear calls, a token alone or in any batch, any thread count."""
    up, down = _layer(kinds, activation)
    assert gm.tiles(up, down)
    x, ids, wts = _inputs(24, 256, seed=2)
    fn = gm.bound_experts(up, down, activation, ggml_int.default_isa())
    got = fn(x, ids, wts)
    assert torch.equal(got, _composed_tiled(x, ids, wts, up, down, activation))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fn(x, ids, wts), got)
    finally:
        torch.set_num_threads(threads)
    for t in (0, 7, 23):
        assert torch.equal(fn(x[t:t + 1], ids[t:t + 1], wts[t:t + 1])[0], got[t])
    # and close to the per-output kernel's layer (another fp32 summation, same 8-bit model)
    other = gm.bound_experts(up, down, activation, ggml_int.default_isa(), tiled=False)
    torch.testing.assert_close(got, other(x, ids, wts), rtol=1e-3, atol=1e-4)
