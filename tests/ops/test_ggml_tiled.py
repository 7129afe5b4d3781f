"""The tiled integer-dot GGUF kernels (ops/ggml_tiled.py), each ISA path this CPU runs, against
oracles the kernel did not produce (those of tests/ops/test_ggml_int.py, whose helpers this
reuses):

1. gguf's dequantization + a float64 matmul, within the bound the 8-bit activation blocks imply
   (sum over blocks of (d_x / 2) * sum |d_w * q|) plus fp32 round-off;
2. the stated algorithm re-done in numpy: equal up to fp32 round-off alone.

Plus: bit-identical across ISA paths, rows 1..17 and threads (batch invariance); the repacked
copy's rows are gguf's values exactly; N % 16 != 0 is refused; edge blocks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl
from specdeploy.ops import ggml_tiled as gt
from tests.ops.test_ggml_int import KINDS as INT_KINDS
from tests.ops.test_ggml_int import Q, _errors, _weight, _x

gguf = pytest.importorskip("gguf")
KINDS = {k: v for k, v in INT_KINDS.items() if k in gt.TILED_KINDS}
HAVE = gt.supported_isas()
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in HAVE, reason=f"this CPU / build does not run {isa} (runs {HAVE})"))
    for isa in gt.ISAS]
# N = 1, 3 and 60 tiles; K = 32 * odd (1, 3, 19 blocks) and the default model's 18 blocks
SHAPES = [(16, 32), (48, 96), (960, 608), (960, 576)]


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n,k", SHAPES[:3])
def test_within_the_activation_rounding_bound_and_equal_to_the_emulation(kind, isa, n, k):
    gw, deq, m = _weight(kind, n, k, seed=n + k)
    tw = gt.repack(gw)
    for rows in (1, 2, 3, 4, 5, 8, 9, 13, 17) if n < 960 else (1, 5, 17):  # NOTE: suite time
        x = _x(rows, k, seed=rows)
        err, err_emul, bound, fp32 = _errors(gt.tiled_linear(x, tw, isa=isa), x, deq, m)
        assert (err_emul <= fp32).all(), (err_emul / fp32).max()
        assert (err <= bound + fp32).all(), ((err - fp32) / bound).max()
    assert (err / np.maximum(bound, 1e-30)).max() > 0.05  # the bound is not vacuous


@pytest.mark.parametrize("kind", list(KINDS))
def test_isa_paths_are_bit_identical_to_scalar(kind):
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    for n, k in SHAPES:
        tw = gt.repack(_weight(kind, n, k, seed=3)[0])
        x = _x(11, k, seed=4)  # a full group of 8 (AVX-512), of 4 (AVX2) and a remainder
        want = gt.tiled_linear(x, tw, isa="scalar")
        for isa in HAVE[1:]:
            assert torch.equal(gt.tiled_linear(x, tw, isa=isa), want), (isa, n, k)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_row_group_size_is_bit_identical_to_scalar(kind):
    """Rows 1..17: every size of a row group (AVX2: 5 for 4-bit kinds, 4 for Q8_0; AVX-512: 8)
    and of its remainder, Q4_1's offset sum in the block loop (1-2 rows) or in a pass of its own
    (3 on), on odd block counts (3, 19)."""
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    for n, k in SHAPES[1:3]:
        tw = gt.repack(_weight(kind, n, k, seed=5)[0])
        x = _x(17, k, seed=6)
        for rows in range(1, 18):
            want = gt.tiled_linear(x[:rows], tw, isa="scalar")
            for isa in HAVE[1:]:
                assert torch.equal(gt.tiled_linear(x[:rows], tw, isa=isa), want), (isa, rows, n)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_batch_and_thread_invariant(kind, isa):
    """Row r's output is bit-identical alone and in any batch of up to 17 rows, at 1 or 2
    threads: a 1-row decode and a K + 1-row verify compute the same numbers."""
    tw = gt.repack(_weight(kind, 208, 96, seed=1)[0])  # 13 tiles: uneven thread ranges
    assert_batch_and_thread_invariant(tw, _x(17, 96, seed=1), isa)


def assert_batch_and_thread_invariant(tw: gt.TiledWeight, x: torch.Tensor, isa: str) -> None:
    """Each row of x through `tw` bit-identical alone, in every prefix batch and in the whole
    one, at 1 and at 2 threads (tests/ops/test_ggml_tiled_kquant.py uses it too)."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = gt.tiled_linear(x, tw, isa=isa)
            for rows in range(1, x.shape[0]):
                assert torch.equal(gt.tiled_linear(x[:rows], tw, isa=isa), full[:rows])
            alone = [gt.tiled_linear(x[i:i + 1], tw, isa=isa) for i in range(x.shape[0])]
            assert torch.equal(torch.cat(alone), full)
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", list(KINDS))
def test_repack_round_trip_and_stacking(kind):
    """tiled_rows gives gguf's dequantized values exactly, every row; a list of weights repacks
    to the tiled copy of their stack (members need not be multiples of 16); same byte count."""
    gw, _, _ = _weight(kind, 48, 96, seed=5)
    tw = gt.repack(gw)
    assert tw.packed.nbytes == gw.blocks.nbytes and tw.shape == (48, 96)
    assert torch.equal(gt.tiled_rows(tw, torch.arange(48)), gl.dequantize(gw))
    ids = torch.tensor([[47, 0], [17, 17]])
    assert torch.equal(gt.tiled_rows(tw, ids), gl.dequantize(gw, ids.reshape(-1)))
    parts = [_weight(kind, n, 96, seed=n)[0] for n in (8, 20, 4)]
    stacked = gt.repack(parts)
    assert torch.equal(stacked.packed, gt.repack(gl.concat_rows(parts)).packed)
    member = gt.TiledMember(stacked, 8, (20, 96))
    assert torch.equal(gt.member_rows(member), gl.dequantize(parts[1]))
    with pytest.raises(IndexError, match="outside"):
        gt.tiled_rows(tw, torch.tensor([48]))
    with pytest.raises(IndexError, match="outside"):
        gt.member_rows(member, torch.tensor([20]))
    # a step's few ids take the host path (<= SMALL_IDS): the same rows, shapes and checks
    few = torch.tensor([[19, 0, 7]], dtype=torch.int32)
    want = gl.dequantize(parts[1])[few.reshape(-1).long()]
    assert torch.equal(gt.member_rows(member, few), want)
    many = torch.arange(gt.SMALL_IDS + 1) % 20
    assert torch.equal(gt.member_rows(member, many), gl.dequantize(parts[1])[many])
    assert gt.member_rows(member, torch.tensor([], dtype=torch.long)).shape == (0, 96)
    for bad in (20, -1):
        with pytest.raises(IndexError, match="outside"):
            gt.member_rows(member, torch.tensor([3, bad]))


def test_outputs_not_a_multiple_of_16_are_refused():
    with pytest.raises(ValueError, match=r"40 outputs \(shape \(40, 64\)\) are not a multiple"):
        gt.repack(_weight("q4_1", 40, 64)[0])
    with pytest.raises(ValueError, match="mixed kinds"):
        gt.repack([_weight("q4_1", 16, 64)[0], _weight("q8_0", 16, 64)[0]])


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_edge_blocks(isa):
    """Q8_0 weights of -128 (w + 128 = 0 unsigned for dpbusd; |w| = 128 for maddubs), an
    all-zero input block (scale 0) and a NaN that must reach the output."""
    k = 64
    blocks = np.zeros((16, 2, 34), np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    blocks[0::2, :, 2:] = np.uint8(0x80)  # int8 -128 everywhere
    blocks[1::2, :, 2:] = np.arange(32, dtype=np.int8).view(np.uint8) * 4  # up to 124
    raw = blocks.reshape(16, 68).copy()
    tw = gt.repack(gl.make_weight("q8_0", torch.from_numpy(raw), (16, k)))
    deq = gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64)
    x = torch.zeros(3, k)
    x[0] = 1.0  # rounds exactly: q = 127, d = 1 / 127
    x[1, 32:] = -torch.arange(32) / 31.0
    x[2, 5] = float("nan")
    y = gt.tiled_linear(x, tw, isa=isa)
    assert y[0, 0] == pytest.approx(-0.5 * 128 * 64, rel=1e-6)
    err, _, bound, fp32 = _errors(y[:2], x[:2], deq, np.zeros_like(deq))
    assert (err <= bound + fp32).all()
    assert torch.isnan(y[2]).all()


def test_bound_closure_equals_the_checked_call():
    tw = gt.repack(_weight("q4_1", 32, 96, seed=2)[0])
    b = torch.randn(32)
    fn = gt.tiled_linear_fn(tw, b, HAVE[-1])
    x = _x(5, 96, seed=3).view(5, 1, 96)
    assert fn(x).shape == (5, 1, 32)
    assert torch.equal(fn(x), gt.tiled_linear(x, tw, isa=HAVE[-1]) + b)
    assert torch.equal(fn(x.transpose(0, 1).contiguous().transpose(0, 1)), fn(x))
    assert fn(torch.zeros(0, 96)).shape == (0, 32)
    with pytest.raises(ValueError, match="last dim 96"):
        fn(torch.randn(2, 64))
    with pytest.raises(ValueError, match="isa: one of"):
        gt.tiled_linear_fn(tw, None, "neon")


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantization_edges_are_the_same_on_every_isa(kind):
    """The SIMD paths quantize x in 8 lanes (ggml_tiled.c `quantize_rows_avx2`), the scalar path
    in C: the same q, d and block sums for non-finite values, all-zero blocks, values that
    round at .5 (to even), and sums that overflow fp32; so the same outputs, NaN where the row
    had a non-finite value or an overflowing block."""
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    tw = gt.repack(_weight(kind, 32, 96, seed=7)[0])
    x = _x(6, 96, seed=8)
    x[0, 3], x[1, 40], x[2, 70] = float("nan"), float("inf"), -float("inf")
    x[3, 32:64] = 0.0
    x[4, :32] = torch.arange(32) - 15.5  # with max|x| = 127 (scale 1): every value a tie
    x[4, 0] = 127.0
    x[5, 64:] = 3e38  # the block's sum overflows: its scale is NaN
    want = gt.tiled_linear(x, tw, isa="scalar")
    assert torch.isnan(want[[0, 1, 2, 5]]).all() and not torch.isnan(want[[3, 4]]).any()
    for isa in HAVE[1:]:
        got = gt.tiled_linear(x, tw, isa=isa)
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), isa
        assert torch.equal(torch.isnan(got), torch.isnan(want)), isa
