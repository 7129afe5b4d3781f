"""The GPU path of `moe_experts` (ops/moe_grouped.py), run on the CPU: each way against the
ref at odd T, k, E with unused experts, and without any host sync."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import moe_experts_ref
from specdeploy.ops.moe_grouped import aligned, moe_experts_grouped


def _case(t, k, e, hdim, inter, activation, dtype=torch.float32, used=None):
    used = e if used is None else used  # experts >= used never chosen
    x = torch.randn(t, hdim, dtype=dtype)
    ids = torch.stack([torch.randperm(used)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64)
    weights = torch.rand(t, k, dtype=dtype)
    rows = 2 * inter if activation == "swiglu" else inter
    w_up = (torch.randn(e, rows, hdim) * 0.3).to(dtype)
    w_down = (torch.randn(e, hdim, inter) * 0.3).to(dtype)
    return x, ids, weights, w_up, w_down, activation


SHAPES = [  # t, k, e, used, H, I: odd counts, unused experts, T*k both sides of E
    (1, 1, 3, 3, 16, 8), (1, 3, 7, 5, 16, 16), (5, 3, 7, 4, 16, 8), (13, 2, 5, 5, 32, 24),
    (31, 3, 9, 6, 16, 8), (7, 5, 11, 11, 32, 16)]


@pytest.mark.parametrize("impl", ["gather", "padded", "grouped_mm"])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_ref(close, impl, activation, shape):
    t, k, e, used, hdim, inter = shape
    case = _case(t, k, e, hdim, inter, activation, used=used)
    if impl == "grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("this torch has no _grouped_mm")
        assert aligned(case[3], case[4])
    close(moe_experts_grouped(*case, impl=impl), moe_experts_ref(*case), rtol=1e-5)


@pytest.mark.parametrize("impl", ["gather", "padded"])
def test_odd_widths(close, impl):
    """Widths _grouped_mm refuses (rows not 16-byte aligned): the other ways take them."""
    case = _case(9, 3, 5, 7, 5, "swiglu")
    assert not aligned(case[3], case[4])
    close(moe_experts_grouped(*case, impl=impl), moe_experts_ref(*case), rtol=1e-5)


def test_auto_on_cpu_is_sync_free_fallback():
    from specdeploy.ops.moe_grouped import _auto

    w_up, w_down = torch.zeros(8, 32, 16), torch.zeros(8, 16, 16)
    assert _auto(torch.device("cpu"), w_up, w_down, pairs=4, experts=8) == "gather"
    assert _auto(torch.device("cpu"), w_up, w_down, pairs=40, experts=8) == "padded"


@pytest.mark.parametrize("impl", ["gather", "padded", "grouped_mm", "auto"])
def test_no_host_sync(monkeypatch, impl):
    """No `.item()` / `.tolist()` / tensor-to-Python conversion anywhere in the path."""
    case = _case(6, 2, 5, 16, 8, "swiglu")
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    expected = moe_experts_ref(*case)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the grouped MoE path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = moe_experts_grouped(*case, impl=impl)
    monkeypatch.undo()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bf16_keeps_dtype(close):
    case = _case(5, 2, 4, 16, 8, "swiglu", dtype=torch.bfloat16)
    for impl in ("gather", "padded"):
        out = moe_experts_grouped(*case, impl=impl)
        assert out.dtype == torch.bfloat16
        close(out.float(), moe_experts_ref(*case).float(), rtol=2e-2)


def test_gather_rows_are_batch_invariant():
    """"gather": a token's output is bit-identical alone and inside a bigger batch (the GEMM ways
    are not: their kernels vary with the rows an expert gets, see the module docstring)."""
    case = _case(11, 2, 6, 16, 8, "relu2")
    x, ids, w = case[:3]
    for impl in ("gather",):
        full = moe_experts_grouped(*case, impl=impl)
        for row in (0, 5, 10):
            one = moe_experts_grouped(x[row:row + 1], ids[row:row + 1], w[row:row + 1],
                                      *case[3:], impl=impl)
            assert torch.equal(one[0], full[row]), (impl, row)


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        moe_experts_grouped(*_case(2, 1, 2, 16, 8, "relu2"), impl="loop")
