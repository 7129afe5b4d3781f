"""The integer-dot ("fast") GGUF kernels, each ISA path this CPU runs, against two oracles the
kernel did not produce:

1. gguf's dequantization + a float64 matmul: the kernel stays within the error bound that the
   8-bit activation blocks imply, sum over blocks of (d_x / 2) * sum |d_w * q|, d_x =
   max|x_block| / 127 (computed here from x), plus fp32 round-off;
2. the stated algorithm re-done in numpy (x rounded to d_x * int8 per block of 32, times gguf's
   dequantized weights, in float64): equal up to fp32 round-off alone, far inside (1).

Plus bit-identical outputs across ISA paths, rows and threads (batch invariance), edge blocks
(-128 weights, all-zero and NaN inputs) and the build / dispatch errors. A path the CPU lacks is
skipped with its reason (AVX-512 VNNI runs only where the CPU has it).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_int as gi
from specdeploy.ops import ggml_linear as gl

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
# q5_0 / q5_1: llama-quantize's fallback for K-quant tensors whose rows are not in 256s
KINDS = {"q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
HAVE = gi.supported_isas()
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in HAVE, reason=f"this CPU / build does not run {isa} (runs {HAVE})"))
    for isa in gi.ISAS]
# odd shapes: 1 block, 3 blocks (odd: the AVX-512 tail), the default model's 18 and 48
SHAPES = [(1, 32), (7, 96), (40, 64), (33, 576), (64, 1536)]


def _weight(kind: str, n: int, k: int, seed: int = 0):
    """(GGMLWeight, gguf's fp32 dequantization, the per-value offset m (0 but for Q4_1 /
    Q5_1))."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.1, 2.0, (n, 1)).astype(
        np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(w, KINDS[kind]))
    deq = gguf.quants.dequantize(raw, KINDS[kind]).astype(np.float64)
    m = np.zeros_like(deq)
    if kind in ("q4_1", "q5_1"):  # block layout (GGUF spec): f16 d, f16 m, (q5_1: qh[4]), qs
        size = gl.KINDS[kind][1]
        mb = raw.reshape(n, k // 32, size)[:, :, 2:4].copy().view(np.float16)[..., 0]
        m = np.repeat(mb.astype(np.float64), 32, axis=1)
    return gl.make_weight(kind, torch.from_numpy(raw), (n, k)), deq, m


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    # heavy-tailed, with a few large channels, as hidden states are
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g).pow(4) * 4
    x[:, ::37] *= 20
    return x


def _x_blocks(x: torch.Tensor):
    """x rounded as stated (fp32: id = 127 / amax, q = rint(x * id), d = amax / 127), float64."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape), d.astype(np.float64)


def _errors(y, x, deq, m):
    """(|y - exact|, |y - emulated|, bound, fp32 scale) per output, all float64 [R, N]."""
    xd = x.double().numpy()
    exact = xd @ deq.T
    xq, d = _x_blocks(x)
    emulated = xq @ (deq - m).T + xd @ m.T  # Q4_1's m meets the exact sum of x
    r, n = xd.shape[0], deq.shape[0]
    wi = np.abs(deq - m).reshape(n, -1, 32).sum(-1)  # sum |d_w q| per weight block
    bound = (d[..., 0] / 2) @ wi.T
    # fp32 round-off of the kernel's sums: per term at most nb + 6 roundings (the d_w * d_x
    # product, one fma per block, the 8-lane sum, Q4_1's m terms), each <= 2^-24 relative to
    # the magnitude of the operands it sums
    nb = xd.shape[1] // 32
    magnitude = np.abs(xq) @ np.abs(deq - m).T + np.abs(xd) @ np.abs(m).T
    fp32 = (nb + 6) * 2.0**-24 * magnitude
    y = y.double().numpy()
    assert y.shape == (r, n)
    return np.abs(y - exact), np.abs(y - emulated), bound, fp32


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n,k", SHAPES)
def test_within_the_activation_rounding_bound_and_equal_to_the_emulation(kind, isa, n, k):
    gw, deq, m = _weight(kind, n, k, seed=n + k)
    for rows in range(1, 17):
        if k > 96 and rows not in (1, 2, 3, 4, 5, 8, 13, 16):
            continue  # NOTE: keeps the scalar path's share of the suite small
        x = _x(rows, k, seed=rows)
        err, err_emul, bound, fp32 = _errors(gi.ggml_linear_int(x, gw, isa=isa), x, deq, m)
        assert (err_emul <= fp32).all(), (err_emul / fp32).max()
        assert (err <= bound + fp32).all(), ((err - fp32) / bound).max()
    # the bound is not vacuous: the error is a real share of it somewhere
    assert (err / np.maximum(bound, 1e-30)).max() > 0.05


@pytest.mark.parametrize("kind", list(KINDS))
def test_isa_paths_are_bit_identical(kind):
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    for n, k in SHAPES:
        gw, _, _ = _weight(kind, n, k, seed=3)
        x = _x(6, k, seed=4)
        ys = [gi.ggml_linear_int(x, gw, isa=isa) for isa in HAVE]
        for isa, y in zip(HAVE[1:], ys[1:]):
            assert torch.equal(y, ys[0]), (isa, n, k)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_batch_and_thread_invariant(kind, isa):
    """A row's output is bit-identical alone and inside any batch of up to 17 rows, at 1 or 2
    threads: a 1-row decode and a K + 1-row verify compute the same numbers."""
    gw, _, _ = _weight(kind, 200, 96, seed=1)
    assert_rows_invariant(gw, _x(17, 96, seed=1), isa)


def assert_rows_invariant(gw, x: torch.Tensor, isa: str) -> None:
    """Each row of x through `gw` on the integer kernel bit-identical alone, in prefix batches
    (1, 3, 4, 5, 8, 16 rows: row groups, remainders, the buffered path) and in the whole one,
    at 1 and 2 threads (tests/ops/test_ggml_iq.py uses it too)."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = gi.ggml_linear_int(x, gw, isa=isa)
            for rows in (1, 3, 4, 5, 8, 16):
                if rows < x.shape[0]:
                    assert torch.equal(gi.ggml_linear_int(x[:rows], gw, isa=isa), full[:rows])
            alone = [gi.ggml_linear_int(x[i:i + 1], gw, isa=isa) for i in range(x.shape[0])]
            assert torch.equal(torch.cat(alone), full)
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_edge_blocks(isa):
    """Q8_0 weights of -128 (|w| = 128 goes through maddubs / dpbusd as unsigned), an all-zero
    input block (scale 0), and a NaN that must reach the output, not vanish into q = 0."""
    k = 64
    blocks = np.zeros((2, 2, 34), np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    blocks[0, :, 2:] = np.uint8(0x80)  # int8 -128 everywhere
    blocks[1, :, 2:] = np.arange(32, dtype=np.int8).view(np.uint8) * 4  # up to 124
    gw = gl.make_weight("q8_0", torch.from_numpy(blocks.reshape(2, 68).copy()), (2, k))
    deq = gguf.quants.dequantize(blocks.reshape(2, 68), Q.Q8_0).astype(np.float64)
    x = torch.zeros(3, k)
    x[0] = 1.0  # rounds exactly: q = 127, d = 1 / 127
    x[1, 32:] = -torch.arange(32) / 31.0
    x[2, 5] = float("nan")
    y = gi.ggml_linear_int(x, gw, isa=isa)
    assert y[0, 0] == pytest.approx(-0.5 * 128 * 64, rel=1e-6)
    err, _, bound, fp32 = _errors(y[:2], x[:2], deq, np.zeros_like(deq))
    assert (err <= bound + fp32).all()
    assert torch.isnan(y[2]).all()


def test_dispatch_errors_and_forced_isa(monkeypatch):
    gw, _, _ = _weight("q4_0", 4, 32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="isa: one of scalar, avx2, avx512_vnni"):
        gi.ggml_linear_int(x, gw, isa="neon")
    missing = [isa for isa in gi.ISAS if isa not in HAVE]
    if missing:
        with pytest.raises(ValueError, match=f"isa '{missing[0]}'"):
            gi.ggml_linear_int(x, gw, isa=missing[0])
        monkeypatch.setenv("SPECDEPLOY_GGML_ISA", missing[0])
        with pytest.raises(ValueError, match="SPECDEPLOY_GGML_ISA"):
            gi.default_isa()
    monkeypatch.setenv("SPECDEPLOY_GGML_ISA", "scalar")
    assert gi.default_isa() == "scalar"
    monkeypatch.delenv("SPECDEPLOY_GGML_ISA")
    assert gi.default_isa() == [isa for isa in HAVE if isa not in gi.UNVERIFIED][-1]
    with pytest.raises(ValueError, match="last dim 32"):
        gi.ggml_linear_int(torch.randn(2, 64), gw)
    assert gi.ggml_linear_int(torch.zeros(0, 32), gw).shape == (0, 4)
    b = torch.randn(4)
    assert torch.equal(gi.ggml_linear_int(x, gw, b), gi.ggml_linear_int(x, gw) + b)


@pytest.fixture
def fresh_int_library(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEPLOY_CACHE_DIR", str(tmp_path))
    gi._library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    gi._library.cache_clear()


def test_build_failure_warns_once_in_one_line(fresh_int_library, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("WARNING", logger="specdeploy"):
        why = gi.kernel_unavailable()
        assert gi.supported_isas() == []  # cached: no second warning
    assert why is not None and "failed" in why
    lines = [r.getMessage() for r in caplog.records if "cannot build" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "cannot build the integer-dot GGUF kernels" in lines[0]
    assert list(fresh_int_library.glob("*.so")) == []
    with pytest.raises(RuntimeError, match="integer ggml kernels unavailable"):
        gi.ggml_linear_int(torch.randn(1, 32), _weight("q8_0", 2, 32)[0])


def test_builds_into_the_cache_dir(fresh_int_library):
    assert gi.kernel_unavailable() is None
    assert len(list(fresh_int_library.glob("ggml_kernels_int-*.so"))) == 1
    assert gi.supported_isas()[0] == "scalar"
