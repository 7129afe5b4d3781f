"""Batch-invariant fp32 kernels (ops/linear_rows.py; sigmoid / softplus in ops/row_kernels.c):
each output's bits independent of the other rows, the row count, the thread count and the ISA
path, and within fp32 rounding of float64 references (exact math)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import linear_rows as lr
from specdeploy.ops import row_kernels as rk

pytestmark = pytest.mark.skipif(lr.library() is None or rk._library() is None,
                                reason="no C compiler here")


def _ref(x, w, b=None):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rows,n,k", [(1, 32, 256), (5, 33, 259), (17, 8, 7), (70, 64, 1000)])
def test_linear_rows_values_and_invariance(rows, n, k):
    g = torch.Generator().manual_seed(rows * 31 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    y = lr.linear_rows(x, w, b)
    ref = _ref(x, w, b)
    # fp32 sums of k products: each term rounds by <= 2^-24 relative; bound on sum |x_i w_i|
    bound = 4 * k * 2.0 ** -24 * (x.abs().double() @ w.abs().double().t()) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    for r in range(rows):  # a row alone, and inside other batch sizes: the same bits
        assert torch.equal(lr.linear_rows(x[r:r + 1], w, b)[0], y[r])
    for cut in (3, 4, 65):
        if cut < rows:
            assert torch.equal(lr.linear_rows(x[:cut], w, b), y[:cut])
    with lr.max_isa(0):  # the generic C gives the AVX2 path's bits
        assert torch.equal(lr.linear_rows(x, w, b), y)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lr.linear_rows(x, w, b), y)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(lr.linear_rows(x.view(1, rows, k), w, b)[0], y)  # leading dims


def test_linear_rows_refuses_other_dtypes():
    with pytest.raises(ValueError, match="linear_rows: fp32 CPU tensors with x"):
        lr.linear_rows(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"x\[\.\.\., 4\]"):
        lr.linear_rows(torch.zeros(2, 5), torch.zeros(3, 4))


def _elems():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(997, generator=g) * 6, torch.tensor(
        [-100.0, -88.0, -87.5, -20.0, -1e-30, 0.0, -0.0, 1e-30, 19.9, 20.0, 20.5, 60.0])])
    return x


@pytest.mark.parametrize("name", ["sigmoid", "softplus"])
def test_elementwise_values_and_position_invariance(name):
    x = _elems()
    fn = getattr(rk, name)
    y = fn(x)
    ref = torch.sigmoid(x.double()) if name == "sigmoid" else torch.nn.functional.softplus(
        x.double())
    # exp_le0's relative error < 2e-7 (row_kernels.c) plus a few roundings
    torch.testing.assert_close(y.double(), ref, rtol=5e-7, atol=1e-37)
    for lo, hi in ((0, 1), (5, 12), (13, 1009), (500, 503)):  # any slice: the same bits
        assert torch.equal(fn(x[lo:hi]), y[lo:hi])
    with rk.max_isa(0):
        assert torch.equal(fn(x), y)
    assert torch.equal(fn(x.view(-1, 1)), y.view(-1, 1))
