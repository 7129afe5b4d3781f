"""gpt-oss's routed experts (biases, clamped SwiGLU) in linear_rows.c's one C call: values
against a float64 dense loop (exact math, ops/moe_bias.py's formula written out here), each
token's bits independent of the other tokens, the thread count and the ISA path, the clamp's
edges (gate above the limit, up beyond +-limit, NaN kept), and `specdeploy::moe_experts_bias`
taking the call on the CPU up to its row limit (no host read: a CPU graph records the step)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import linear_rows as lr
from specdeploy.ops import moe_bias

pytestmark = pytest.mark.skipif(lr.moe_unavailable() is not None, reason="no C compiler here")
ALPHA, LIMIT = 1.702, 7.0


def _case(e, h, i, t, k, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w_up = (torch.randn(e, 2 * i, h, generator=g) * scale / h**0.5).to(dtype)
    b_up = (torch.randn(e, 2 * i, generator=g) * scale).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    b_down = torch.randn(e, h, generator=g).to(dtype)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    return x, ids, wts, w_up, b_up, w_down, b_down


def _ref64(x, ids, wts, w_up, b_up, w_down, b_down):
    """float64: h = W_up x + b_up; g = min(h_gate, L); u = clamp(h_up, +-L);
    a = (u + 1) g sigmoid(alpha g); y = W_down a + b_down; out = sum_j w_j y_j"""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w_up[e].double() @ x[t].double() + b_up[e].double()
            gate, up = h.chunk(2)
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            a = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t] += wts[t, j].double() * (w_down[e].double() @ a + b_down[e].double())
    return out


def _call(x, ids, wts, w_up, b_up, w_down, b_down):
    return lr.moe_rows(x, ids, wts, w_up, w_down, "swiglu_oai", b_up, b_down, ALPHA, LIMIT)


SHAPES = [(8, 256, 192, 4, 2), (5, 40, 24, 7, 3), (32, 97, 33, 3, 4), (6, 64, 16, 70, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_invariance(shape, dtype):
    case = _case(*shape, dtype, scale=4.0)  # pre-activations well past +-7: the clamps act
    x, ids, wts, w_up, b_up, w_down, b_down = case
    h = torch.einsum("eoh,th->teo", w_up.float(), x) + b_up.float()
    assert (h[..., : shape[2]] > LIMIT).any() and (h[..., shape[2]:].abs() > LIMIT).any()
    y = _call(*case)
    ref = _ref64(*case)
    # fp32 sums of <= 256 products through two matrices, a sigmoid and biases: 1e-5 of the
    # output's scale (a float32 oracle in the same order differs by ~1e-6 of it)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    t = x.shape[0]
    for r in range(t):  # a token alone: the same bits as beside the others
        one = _call(x[r:r + 1], ids[r:r + 1], wts[r:r + 1], w_up, b_up, w_down, b_down)
        assert torch.equal(one[0], y[r])
    for level in (0, 1):  # the generic C and the AVX2 path give the widest path's bits
        with lr.max_isa(level):
            assert torch.equal(_call(*case), y), level
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_call(*case), y)
    finally:
        torch.set_num_threads(before)


def test_without_biases_is_the_biasless_form():
    x, ids, wts, w_up, b_up, w_down, b_down = _case(6, 48, 16, 5, 2, torch.float32)
    got = lr.moe_rows(x, ids, wts, w_up, w_down, "swiglu_oai", None, None, ALPHA, LIMIT)
    ref = _ref64(x, ids, wts, w_up, torch.zeros_like(b_up), w_down, torch.zeros_like(b_down))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_nan_gate_stays_nan_as_torch_clamp():
    x, ids, wts, w_up, b_up, w_down, b_down = _case(4, 32, 8, 2, 1, torch.float32)
    b_up = b_up.clone()
    b_up[ids[0, 0], 3] = float("nan")  # expert of token 0: one gate NaN -> its output NaN
    y = _call(x, ids, wts, w_up, b_up, w_down, b_down)
    assert y[0].isnan().all()
    ref = moe_bias.moe_experts_bias_ref(x, ids, wts, w_up, b_up, w_down, b_down, "swiglu_oai",
                                        ALPHA, LIMIT)
    assert ref[0].isnan().all()
    if ids[1, 0] != ids[0, 0]:
        assert not y[1].isnan().any()


def test_refusals():
    x, ids, wts, w_up, b_up, w_down, b_down = _case(4, 32, 16, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="fit together.*biases"):
        lr.moe_rows(x, ids, wts, w_up, w_down, "swiglu_oai", b_up[:, :16], b_down)
    with pytest.raises(ValueError, match="fit together"):
        lr.moe_rows(x, ids, wts, w_up, w_down, "swiglu_oai", b_up, b_down[:3])
    with pytest.raises(ValueError, match="fit together"):  # swiglu_oai's up rows are 2I
        lr.moe_rows(x, ids, wts, w_up[:, :16], w_down, "swiglu_oai")


@pytest.mark.parametrize("t", [1, 16, 17, moe_bias.ONE_CALL_MAX_TOKENS,
                               moe_bias.ONE_CALL_MAX_TOKENS + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_custom_op_takes_the_one_call_up_to_its_limit(t, dtype, monkeypatch):
    case = _case(6, 48, 24, t, 2, dtype, seed=t, scale=3.0)
    calls = []
    real = lr.moe_rows
    monkeypatch.setattr(lr, "moe_rows", lambda *a: calls.append(1) or real(*a))
    out = torch.ops.specdeploy.moe_experts_bias(*case[:3], *case[3:], "swiglu_oai", ALPHA, LIMIT)
    assert len(calls) == (t <= moe_bias.ONE_CALL_MAX_TOKENS)
    ref = _ref64(*case)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_gradient_takes_the_torch_form():
    case = list(_case(4, 32, 8, 3, 2, torch.float32))
    x = case[0].requires_grad_()
    out = torch.ops.specdeploy.moe_experts_bias(x, *case[1:], "swiglu_oai", ALPHA, LIMIT)
    out.sum().backward()
    xd = case[0].detach().double().requires_grad_()
    ref = moe_bias.moe_experts_bias_ref(xd, case[1], case[2].double(), *(
        c.double() for c in case[3:]), "swiglu_oai", ALPHA, LIMIT)
    ref.sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)
