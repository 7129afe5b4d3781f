"""A MoE layer's fp32 / bf16 / fp16 routed experts in one C call (linear_rows.c `moe_rows`): values
against a float64 dense loop (exact math), each token's bits independent of the other tokens,
the thread count and the ISA path, and the CPU's `specdeploy::moe_experts` taking it up to
ONE_CALL_MAX_TOKENS tokens (the per-expert loop above)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import linear_rows as lr
from specdeploy.ops import moe
from specdeploy.ops.moe_grouped import expert_activation

pytestmark = pytest.mark.skipif(lr.moe_unavailable() is not None, reason="no C compiler here")


def _case(e, h, i, t, k, activation, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_up = 2 * i if activation == "swiglu" else i
    w_up = (torch.randn(e, n_up, h, generator=g) / h**0.5).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    return x, ids, wts, w_up, w_down


def _ref64(x, ids, wts, w_up, w_down, activation):
    """float64 dense per-token loop on the weights' exact values"""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hid = expert_activation(x[t].double() @ w_up[e].double().t(), activation)
            out[t] += wts[t, j].double() * (hid @ w_down[e].double().t())
    return out


SHAPES = [(8, 256, 192, 4, 2), (5, 40, 24, 7, 3), (16, 97, 33, 3, 4), (6, 64, 16, 70, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_invariance(shape, activation, dtype):
    x, ids, wts, w_up, w_down = _case(*shape, activation, dtype)
    y = lr.moe_rows(x, ids, wts, w_up, w_down, activation)
    ref = _ref64(x, ids, wts, w_up, w_down, activation)
    # fp32 sums of <= 256 products through two matrices and a SiLU: 1e-5 of the output scale
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    t = x.shape[0]
    for r in range(t):  # a token alone: the same bits as beside the others
        assert torch.equal(lr.moe_rows(x[r:r + 1], ids[r:r + 1], wts[r:r + 1], w_up, w_down,
                                       activation)[0], y[r])
    assert torch.equal(lr.moe_rows(x[: t // 2 + 1], ids[: t // 2 + 1], wts[: t // 2 + 1], w_up,
                                   w_down, activation), y[: t // 2 + 1])
    for level in (0, 1):  # the generic C and the AVX2 path give the AVX-512 path's bits
        with lr.max_isa(level):
            assert torch.equal(lr.moe_rows(x, ids, wts, w_up, w_down, activation), y), level
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lr.moe_rows(x, ids, wts, w_up, w_down, activation), y)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [32, 21], ids=["lanes", "tail"])
def test_16_bit_weights_widen_exactly_on_every_path(dtype, k):
    """Each 16-bit weight is the fp32 value it is: with the up matrix the identity, relu2 and
    x a unit vector e_j, the output is column j of the down matrix itself. Its values span the
    type: subnormals, the smallest and largest normals, signed zeros (F16C's conversion and the
    generic C's must agree bit for bit), at full 16-lane strides and at a tail."""
    info = torch.finfo(dtype)
    special = torch.tensor([info.tiny, info.tiny / 4, info.smallest_normal, -info.tiny, 0.0,
                            -0.0, 1.0, -3.140625, info.max, -info.max, 2.0**-20, 65.0],
                           dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    w_down = torch.randn(1, k, k, generator=g).to(dtype)
    w_down[0, : len(special), 0] = special.to(dtype)
    w_down[0, 0, : len(special)] = special.to(dtype)
    w_up = torch.eye(k).to(dtype)[None]
    x = torch.eye(k)
    ids, wts = torch.zeros(k, 1, dtype=torch.int64), torch.ones(k, 1)
    want = w_down[0].float().t()  # row j: column j of the down matrix, widened by torch
    for level in (0, 1, 2):
        with lr.max_isa(level):
            y = lr.moe_rows(x, ids, wts, w_up, w_down, "relu2")
            assert torch.equal(y, want), level


def test_bf16_input_keeps_dtype_and_matches_fp32_input():
    x, ids, wts, w_up, w_down = _case(8, 64, 32, 5, 2, "swiglu", torch.bfloat16)
    xb = x.to(torch.bfloat16)
    y = lr.moe_rows(xb, ids, wts, w_up, w_down, "swiglu")
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, lr.moe_rows(xb.float(), ids, wts, w_up, w_down, "swiglu").to(
        torch.bfloat16))


def test_refusals():
    x, ids, wts, w_up, w_down = _case(4, 32, 16, 3, 2, "relu2", torch.float32)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        lr.moe_rows(x, ids + 3, wts, w_up, w_down, "relu2")
    with pytest.raises(ValueError, match="activation: one of swiglu, relu2"):
        lr.moe_rows(x, ids, wts, w_up, w_down, "gelu")
    with pytest.raises(ValueError, match="fit together"):
        lr.moe_rows(x, ids, wts, w_up, w_down, "swiglu")  # up rows are I, not 2I
    with pytest.raises(ValueError, match="fit together"):
        lr.moe_rows(x, ids, wts, w_up.double(), w_down.double(), "relu2")
    with pytest.raises(ValueError, match=r"x \[T, 32\]"):
        lr.moe_rows(x[:, :16], ids, wts, w_up, w_down, "relu2")


@pytest.mark.parametrize("t", [1, 4, moe.ONE_CALL_MAX_TOKENS, moe.ONE_CALL_MAX_TOKENS + 1])
def test_custom_op_takes_the_one_call_up_to_its_limit(t, monkeypatch):
    x, ids, wts, w_up, w_down = _case(6, 48, 24, t, 2, "swiglu", torch.float32, seed=t)
    calls = []
    real = lr.moe_rows
    monkeypatch.setattr(lr, "moe_rows", lambda *a: calls.append(1) or real(*a))
    out = torch.ops.specdeploy.moe_experts(x, ids, wts, w_up, w_down, "swiglu")
    assert len(calls) == (t <= moe.ONE_CALL_MAX_TOKENS)
    ref = _ref64(x, ids, wts, w_up, w_down, "swiglu")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
