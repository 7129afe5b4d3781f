from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specdeploy.ops  # noqa: F401
from specdeploy.ops import Routing, moe_experts_ref, route_sigmoid, route_softmax_topk


def _dense_moe(x, ids, weights, w_up, w_down, activation):
    """Every expert on every token, combined with a dense [T, E] weight matrix."""
    combine = torch.zeros(x.shape[0], w_up.shape[0]).scatter_add_(1, ids, weights)
    h = torch.einsum("th,eih->tei", x, w_up)
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.relu(h) ** 2
    return torch.einsum("tei,ehi,te->th", h, w_down, combine)


@pytest.mark.parametrize("t", (1, 7, 63))
@pytest.mark.parametrize("activation", ("swiglu", "relu2"))
def test_moe_experts_match_dense(close, t, activation):
    e, hdim, inter, k = 6, 16, 12, 2
    x = torch.randn(t, hdim)
    # experts 4 and 5 never chosen: the grouped kernel must skip them cleanly
    ids = torch.stack([torch.randperm(4)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    up_rows = 2 * inter if activation == "swiglu" else inter
    w_up, w_down = torch.randn(e, up_rows, hdim) * 0.3, torch.randn(e, hdim, inter) * 0.3
    out = torch.ops.specdeploy.moe_experts(x, ids, weights, w_up, w_down, activation)
    expected = _dense_moe(x, ids, weights, w_up, w_down, activation)
    close(out, expected)
    close(moe_experts_ref(x, ids, weights, w_up, w_down, activation), expected)


def test_moe_experts_bf16_keeps_dtype(close):
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    ids, w = torch.randint(0, 3, (5, 2)), torch.rand(5, 2, dtype=torch.bfloat16)
    w_up = torch.randn(3, 8, 8, dtype=torch.bfloat16)
    w_down = torch.randn(3, 8, 4, dtype=torch.bfloat16)
    out = torch.ops.specdeploy.moe_experts(x, ids, w, w_up, w_down, "swiglu")
    assert out.dtype == torch.bfloat16
    close(out.float(), moe_experts_ref(x, ids, w, w_up, w_down, "swiglu").float(), rtol=2e-2)


def test_softmax_topk_hand_case(close):
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    r = route_softmax_topk(logits, 2, renormalize=False)
    assert isinstance(r, Routing)
    assert r.ids.tolist() == [[1, 3]]
    close(r.weights, torch.tensor([[0.4, 0.3]]))
    r = route_softmax_topk(logits, 2, renormalize=True)
    close(r.weights, torch.tensor([[4 / 7, 3 / 7]]))


def test_sigmoid_routing_hand_case(close):
    # scores s = sigmoid(logits); bias only changes which experts are picked
    s = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.6, 0.7, 0.5, 0.4]])
    logits = torch.logit(s)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    # 4 groups of 2: biased group scores (top-2 sums) = 1.0, 0.5, 1.3, 1.4 -> keep groups 3, 2
    r = route_sigmoid(logits, bias, k=2, n_group=4, topk_group=2, renormalize=False)
    assert sorted(r.ids[0].tolist()) == [5, 7]  # expert 0 (0.9) is in a dropped group
    close(r.weights.sort(-1).values, torch.tensor([[0.4, 0.7]]))
    r = route_sigmoid(logits, bias, 2, 4, 2, renormalize=True, scaling_factor=2.0)
    close(r.weights.sort(-1).values, torch.tensor([[0.8 / 1.1, 1.4 / 1.1]]))
    r = route_sigmoid(logits, None, k=3)
    assert sorted(r.ids[0].tolist()) == [0, 4, 5]


@pytest.mark.parametrize("case", ["softmax", "softmax_raw", "sigmoid", "sigmoid_groups",
                                  "sigmoid_no_bias"])
def test_routing_kernel_matches_torch_routing(case):
    """The C routing (row_kernels.c moe_route_rows, what the ops run on the CPU in fp32)
    against the torch routing (ops/moe.py's `_*_torch`, transformers' order of operations):
    the same experts (softmax: in torch's descending order), weights within 1e-6, each row
    alone the same bits as in the batch."""
    from specdeploy.ops import moe, row_kernels

    g = torch.Generator().manual_seed(len(case))
    t, e, k = 37, 64, 6
    logits = torch.randn(t, e, generator=g) * 3
    bias = torch.randn(e, generator=g) * 0.5
    if case.startswith("softmax"):
        renorm = case == "softmax"
        got = row_kernels.moe_route(logits, None, k, False, renormalize=renorm)
        want = moe._softmax_topk_torch(logits, k, renorm)
        assert torch.equal(got[0], want[0])
    else:
        groups = (8, 3) if case == "sigmoid_groups" else (1, 1)
        b = None if case == "sigmoid_no_bias" else bias
        got = row_kernels.moe_route(logits, b, k, True, *groups, True, 2.5)
        want = moe._sigmoid_torch(logits, b, k, *groups, True, 2.5)
        order = want[0].argsort(-1)  # torch's sorted=False order: compare as sets
        want = (want[0].gather(1, order), want[1].gather(1, order))
        order = got[0].argsort(-1)
        got = (got[0].gather(1, order), got[1].gather(1, order))
        assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    full = row_kernels.moe_route(logits, None, k, False)
    for r in (0, 17, 36):
        one = row_kernels.moe_route(logits[r:r + 1], None, k, False)
        assert torch.equal(one[0][0], full[0][r]) and torch.equal(one[1][0], full[1][r])


def test_routing_kernel_ties_and_refusals():
    """Ties go to the lower id (torch's topk may pick either: a tie is not a test of it); the
    op routes in torch where the kernel refuses (a k above the kept groups' experts)."""
    from specdeploy.ops import row_kernels

    logits = torch.zeros(2, 8)
    ids, w = row_kernels.moe_route(logits, None, 3, False)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))
    assert row_kernels.moe_route(logits, None, 9, False) is None
    assert row_kernels.moe_route(logits, None, 5, True, 4, 2) is None  # 2 groups of 2 < 5
    r = route_sigmoid(torch.randn(3, 8), torch.zeros(8), 5, 4, 2)  # still routed, in torch
    assert r.ids.shape == (3, 5) and len(set(r.ids[0].tolist())) == 5
