"""Batch-invariant fp32 kernels (ops/linear_rows.py; sigmoid / softplus / exp / silu in
ops/row_kernels.c): each output's bits independent of the other rows, the row count, the thread
count and the ISA path, and within fp32 rounding of float64 references (exact math)."""
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
    for level in (0, 1):  # the generic C and the AVX2 path give the AVX-512 path's bits
        with lr.max_isa(level):
            assert torch.equal(lr.linear_rows(x, w, b), y), level
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


REFS = {"sigmoid": torch.sigmoid, "softplus": torch.nn.functional.softplus, "exp": torch.exp,
        "silu": torch.nn.functional.silu}


@pytest.mark.parametrize("name", sorted(REFS))
def test_elementwise_values_and_position_invariance(name):
    x = _elems()
    if name == "exp":  # the whole range: subnormal results, overflow, -inf (masked decays)
        x = torch.cat([x, torch.tensor([-103.0, -104.5, -1e4, 88.5, 88.8, 1e4, float("-inf"),
                                        float("inf")])])
    y = rk.elementwise(name, x)
    ref = REFS[name](x.double())
    # the exp polynomial's relative error < 2e-7 (row_kernels.c) plus a few roundings; exp's
    # subnormal results within a few of their steps (1.4e-45); the others take e^-|x| floored
    # at e^-87 (1.6e-38; silu: x times that, |x| <= 100 here)
    atol = {"exp": 1e-44, "silu": 2e-36}.get(name, 2e-38)
    torch.testing.assert_close(y.double(), ref.to(torch.float32).double(), rtol=5e-7,
                               atol=atol, equal_nan=True)
    if name == "exp":
        assert y[-2] == 0 and y[-1] == float("inf") and torch.isnan(rk.elementwise(
            "exp", torch.tensor([float("nan")])))[0]
    for lo, hi in ((0, 1), (5, 12), (13, 1009), (500, 503)):  # any slice: the same bits
        assert torch.equal(rk.elementwise(name, x[lo:hi]), y[lo:hi])
    big = x.repeat(40)  # > one 16384-element block: split across threads
    assert torch.equal(rk.elementwise(name, big), y.repeat(40))
    with rk.max_isa(0):
        assert torch.equal(rk.elementwise(name, x), y)
