"""MXFP4 blocks (ggml type 39) on the tiled integer-dot kernels (ops/ggml_tiled.c), each ISA path
this CPU runs, and on the exact fp32 kernel (ops/ggml_kernels.c), against oracles the kernels did
not produce:

1. the same values written here as Q8_0 blocks (this file's own doubled-E2M1 table, fp16 d =
   2^(e - 128)) through the Q8_0 tiled kernel: bit-identical, since the integer block sums and
   the scales are the same exact numbers (e in 104..143, where an fp16 d exists);
2. the stated algorithm re-done in numpy (x quantized as `quantize_rows`, exact integer dot,
   scale = d_w * d_x in fp32, acc = fma(p, scale, acc)) for e from 0 (a subnormal d_w) to 254:
   bit-identical;
3. gguf-py's MXFP4 dequantization for the tiled copy's rows: bit-identical.

Plus: scalar = AVX2 at rows 1..9, a row alone = in a batch, 1 thread = 2 threads. The exact
kernel: the Q8_0 copy's outputs and gguf-py's values (dequantize, embedding rows), bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl
from specdeploy.ops import ggml_tiled as gt
from tests.ops.test_ggml_int import _x

gguf = pytest.importorskip("gguf")
HAVE = gt.supported_isas()
pytestmark = pytest.mark.skipif(not HAVE, reason="tiled kernels unavailable")
TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
E_EDGES = (0, 1, 2, 104, 127, 143, 200, 254)
# K: 1, 3, 5 and 17 blocks (none a multiple of 256); N: 1, 3, 2 and 13 tiles
SHAPES = [(16, 32), (48, 96), (32, 160), (208, 544)]


def _raw(n: int, k: int, es, seed: int) -> np.ndarray:
    """uint8 [n, k / 32 * 17]: ggml MXFP4 blocks, each e drawn from `es`, random nibbles, and
    every 7th block's values all zero (codes 0 and 8: +0 and -0)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    e = rng.choice(np.asarray(es, np.uint8), size=(n, nb, 1))
    qs = rng.integers(0, 256, size=(n, nb, 16), dtype=np.uint8)
    qs.reshape(-1, 16)[::7] = 0x80
    return np.ascontiguousarray(np.concatenate((e, qs), -1).reshape(n, nb * 17))


def _codes(raw: np.ndarray):
    """(codes [n, nb, 32] in element order, e [n, nb]) of rows of MXFP4 blocks."""
    b = raw.reshape(raw.shape[0], -1, 17)
    return np.concatenate((b[..., 1:] & 0x0F, b[..., 1:] >> 4), -1), b[..., 0]


def _as_q8_0(raw: np.ndarray) -> np.ndarray:
    """The same values as Q8_0 blocks: d = 2^(e - 128) in fp16, q = the table's integers."""
    codes, e = _codes(raw)
    d = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float16)
    assert np.array_equal(d.astype(np.float64), np.ldexp(1.0, e.astype(np.int32) - 128))
    out = np.concatenate((d[..., None].view(np.uint8), TABLE[codes].astype(np.int8).view(
        np.uint8)), -1)
    return np.ascontiguousarray(out.reshape(raw.shape[0], -1))


def _weight(kind: str, raw: np.ndarray, k: int) -> gt.TiledWeight:
    return gt.repack(gl.make_weight(kind, torch.from_numpy(raw), (raw.shape[0], k)))


def _emulate(raw: np.ndarray, x: torch.Tensor) -> np.ndarray:
    """fp32 [R, N]: the kernel's stated operations, in numpy."""
    f32, f64 = np.float32, np.float64
    xb = x.numpy().astype(f32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    dx = (amax / f32(127)).astype(f32)
    codes, e = _codes(raw)
    p = np.einsum("rbi,nbi->rnb", q, TABLE[codes])  # exact integer block sums
    dw = np.ldexp(1.0, e.astype(np.int32) - 128).astype(f32)  # exact: 2^-128 is an fp32 too
    scale = (dw[None] * dx[:, None]).astype(f32)  # one fp32 rounding (subnormals included)
    acc = np.zeros(p.shape[:2], f32)
    for b in range(p.shape[2]):  # fma: the product is exact in float64, then one rounding
        acc = (p[..., b].astype(f64) * scale[..., b].astype(f64) + acc.astype(f64)).astype(f32)
    return acc


@pytest.mark.parametrize("isa", HAVE)
@pytest.mark.parametrize("n,k", SHAPES)
def test_bit_identical_to_the_q8_0_kernel_on_the_same_values(isa, n, k):
    raw = _raw(n, k, range(104, 144), seed=n + k)
    mx, q8 = _weight("mxfp4", raw, k), _weight("q8_0", _as_q8_0(raw), k)
    assert mx.packed.nbytes * 2 == q8.packed.nbytes  # 17 bytes a block, not 34
    x = _x(9, k, seed=k)
    for rows in range(1, 10):
        got = gt.tiled_linear(x[:rows], mx, isa=isa)
        assert torch.equal(got, gt.tiled_linear(x[:rows], q8, isa=isa)), (rows, n, k)
    assert got.abs().max() > 0


@pytest.mark.parametrize("isa", HAVE)
@pytest.mark.parametrize("e", E_EDGES)
def test_every_scale_equals_the_emulation(isa, e):
    """Blocks at e - 1, e, e + 1: d_w from a subnormal 2^-128 to 2^126; x at scale 1 (e = 0:
    subnormal d_w * d_x; e = 254: overflows, inf / NaN where the emulation has them) and at a
    scale that keeps the outputs finite."""
    n, k = 48, 160
    raw = _raw(n, k, sorted({max(e - 1, 0), e, min(e + 1, 254)}), seed=e)
    tw = _weight("mxfp4", raw, k)
    for s in (1.0, 2.0 ** int(np.clip(128 - e, -100, 60))):
        x = _x(7, k, seed=e + 1) * s
        with np.errstate(all="ignore"):
            want = _emulate(raw, x)
        got = gt.tiled_linear(x, tw, isa=isa).numpy()
        assert np.array_equal(got, want, equal_nan=True), (e, s)
        if s != 1.0 or 2 <= e <= 200:
            assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_rows_are_gguf_values():
    """tiled_rows (the embedding / dequantized-weight path) gives gguf-py's MXFP4 values, bit
    for bit (e = 0 and 1: subnormals; code 8 is +0 as ggml reads it), and the Q8_0 copy's."""
    raw = _raw(48, 96, E_EDGES, seed=3)
    got = gt.tiled_rows(_weight("mxfp4", raw, 96), torch.arange(48)).numpy()
    with np.errstate(over="ignore"):  # e = 254: 12 * 2^126 is inf in fp32 (so in ours)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    mid = _raw(48, 96, range(104, 144), seed=4)
    ids = torch.tensor([47, 0, 16, 5])
    assert torch.equal(gt.tiled_rows(_weight("mxfp4", mid, 96), ids),
                       gt.tiled_rows(_weight("q8_0", _as_q8_0(mid), 96), ids))


def test_isa_paths_rows_and_threads_are_bit_identical():
    n, k = 208, 544  # 13 tiles: uneven thread ranges
    tw = _weight("mxfp4", _raw(n, k, E_EDGES[2:7], seed=5), k)
    x = _x(9, k, seed=6)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = gt.tiled_linear(x, tw, isa=HAVE[0])
            for isa in HAVE:
                for rows in range(1, 10):  # every row group size of AVX2 (4) and remainder
                    assert torch.equal(gt.tiled_linear(x[:rows], tw, isa=isa), full[:rows])
                alone = [gt.tiled_linear(x[i:i + 1], tw, isa=isa) for i in range(9)]
                assert torch.equal(torch.cat(alone), full), isa
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


def test_other_kinds_are_refused_by_repack(monkeypatch):
    """(every GGUF block kind has a tiled kernel now: one taken off the list stands in)"""
    monkeypatch.setattr(gt, "TILED_KINDS", tuple(k for k in gt.TILED_KINDS if k != "iq4_xs"))
    raw = np.zeros((16, 136), np.uint8)
    with pytest.raises(ValueError, match="no tiled kernel for iq4_xs"):
        gt.repack(gl.make_weight("iq4_xs", torch.from_numpy(raw), (16, 256)))


def test_exact_kernel_equals_the_q8_0_one_and_gguf_values():
    """kernels="exact": the same fp32 weights as the Q8_0 copy (so the same outputs, bit for
    bit, at every row group size), and `dequantize` / `ggml_embedding` give gguf-py's values."""
    if gl.kernel_unavailable():
        pytest.skip(gl.kernel_unavailable())
    for n, k in SHAPES[1:]:
        raw = _raw(n, k, range(104, 144), seed=k)
        mx = gl.make_weight("mxfp4", torch.from_numpy(raw), (n, k))
        q8 = gl.make_weight("q8_0", torch.from_numpy(_as_q8_0(raw)), (n, k))
        x = _x(9, k, seed=n)
        for rows in range(1, 10):
            assert torch.equal(gl.ggml_linear(x[:rows], mx), gl.ggml_linear(x[:rows], q8))
    raw = _raw(40, 96, E_EDGES, seed=8)
    w = gl.make_weight("mxfp4", torch.from_numpy(raw), (40, 96))
    with np.errstate(over="ignore"):
        want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
    assert torch.equal(gl.dequantize(w).view(torch.int32), want.view(torch.int32))
    ids = torch.tensor([[39, 0], [7, 7]])
    assert torch.equal(gl.ggml_embedding(ids, w).view(torch.int32), want[ids].view(torch.int32))
    stacked = gl.make_weight("mxfp4", torch.from_numpy(raw).view(2, 20, -1), (2, 20, 96))
    assert torch.equal(gl.dequantize(stacked).view(torch.int32), want.view(2, 20, 96).view(
        torch.int32))
