"""FP8 / NVFP4 linear and routed-expert ops: fast CPU paths against their refs at odd shapes,
quantize → dequantize error within each format's bound, the packed layout bit for bit, and
export (fake kernels)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops.fp8_linear import (
    dequantize_fp8,
    fp8_linear_ref,
    quantize_fp8_block,
    quantize_fp8_tensor,
    row_scales_from_blocks,
)
from specdeploy.ops.nvfp4_linear import (
    dequantize_nvfp4,
    nvfp4_linear_ref,
    quantize_nvfp4,
    unpack_e2m1,
)
from specdeploy.ops.quant_moe import fp8_moe_experts_ref, nvfp4_moe_experts_ref

ops = torch.ops.specdeploy
# (rows B*T, K, N): one row, odd K (block FP8 partial edge blocks), N over the 256-row tile
SHAPES = [(1, 64, 96), (7, 200, 300), (33, 144, 513), (0, 32, 16)]


def _fp8_weight(n, k, block):
    w = torch.randn(n, k)
    if block:
        q, s_inv = quantize_fp8_block(w)
        return w, q, row_scales_from_blocks(s_inv, n, 128), 128
    q, s = quantize_fp8_tensor(w)
    return w, q, s.reshape(1, 1).expand(n, 1).contiguous(), k


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", (False, True))
@pytest.mark.parametrize("static", (False, True))
def test_fp8_linear_matches_ref(shape, block, static, close):
    m, k, n = shape
    _, q, s, bk = _fp8_weight(n, k, block)
    x = torch.randn(m, k)
    in_s = torch.tensor(3.0 / 448) if static else None
    bias = torch.randn(n)
    close(ops.fp8_linear(x, q, s, bk, in_s, bias), fp8_linear_ref(x, q, s, bk, in_s, bias))


def test_fp8_rounding_bounds():
    """e4m3 has 3 mantissa bits: round-to-nearest errs by at most 2^-4 relative above the normal
    range (2^-6 · scale), by half the subnormal step (2^-10 · scale) below it."""
    w = torch.randn(130, 300) * torch.logspace(-3, 1, 300)
    q_t, s_t = quantize_fp8_tensor(w)
    q_b, s_b = quantize_fp8_block(w)
    for q, s, bk in ((q_t, s_t.reshape(1, 1).expand(130, 1), 300),
                     (q_b, row_scales_from_blocks(s_b, 130, 128), 128)):
        col = s.repeat_interleave(bk, 1)[:, :300]
        err = (dequantize_fp8(q, s, bk) - w).abs()
        bound = torch.maximum(w.abs() * 2.0**-4, col * 2.0**-10) * (1 + 1e-6)
        assert bool((err <= bound).all())


def test_nvfp4_bounds_and_layout():
    """Each value is the nearest of E2M1's grid times its group scale: error at most half the
    grid step at its magnitude (≤ 1 · s at the top, 4 → 6), plus the group scale's own e4m3
    rounding (≤ 2^-4 relative, carried by values up to 6 · s)."""
    w = torch.randn(70, 160)
    p, s, s2 = quantize_nvfp4(w)
    assert p.dtype == torch.uint8 and p.shape == (70, 80)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (70, 10) and s2.shape == ()
    deq = dequantize_nvfp4(p, s, s2)
    group_amax = w.view(70, 10, 16).abs().amax(-1, keepdim=True)
    step = (group_amax / 6.0) * 2.0  # the widest grid step (4 → 6) in units of the group scale
    bound = step / 2 + group_amax * 2.0**-4
    assert bool(((deq - w).view(70, 10, 16).abs() <= bound * (1 + 1e-6)).all())
    # low nibble = even element; bit 3 = sign
    byte = torch.tensor([[0x7A]], dtype=torch.uint8)  # low 0xA (-1.0), high 0x7 (6.0)
    assert unpack_e2m1(byte).tolist() == [[-1.0, 6.0]]


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_linear_matches_ref(shape, close):
    m, k, n = shape
    k = k // 16 * 16
    p, s, s2 = quantize_nvfp4(torch.randn(n, k))
    s2 = s2.expand(n).contiguous()
    x = torch.randn(m, k)
    close(ops.nvfp4_linear(x, p, s, s2, None), nvfp4_linear_ref(x, p, s, s2))


def test_bf16_inputs_keep_their_dtype():
    _, q, s, bk = _fp8_weight(40, 64, True)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = ops.fp8_linear(x, q, s, bk, None, None)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), fp8_linear_ref(x, q, s, bk).float(), atol=0.05)


def _experts(e, rows, cols, kind):
    ws = [torch.randn(rows, cols) * cols**-0.5 for _ in range(e)]
    if kind == "nvfp4":
        parts = [quantize_nvfp4(w) for w in ws]
        return (torch.stack([p for p, _, _ in parts]), torch.stack([s for _, s, _ in parts]),
                torch.stack([s2.expand(rows) for _, _, s2 in parts]))
    qs = [quantize_fp8_block(w) for w in ws]
    return (torch.stack([q for q, _ in qs]),
            torch.stack([row_scales_from_blocks(s, rows, 128) for _, s in qs]), 128)


@pytest.mark.parametrize("kind", ("fp8", "nvfp4"))
@pytest.mark.parametrize("act", ("swiglu", "relu2"))
def test_quantized_experts_match_ref(kind, act, close):
    e, h, i, t, k = 6, 48, 32, 19, 2
    up = _experts(e, 2 * i if act == "swiglu" else i, h, kind)
    down = _experts(e, h, i, kind)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    wts = torch.rand(t, k)
    if kind == "fp8":
        scales = (torch.tensor(4.0 / 448), torch.tensor(2.0 / 448))
        got = ops.fp8_moe_experts(x, ids, wts, *up, *down, act, *scales)
        want = fp8_moe_experts_ref(x, ids, wts, *up, *down, act, *scales)
    else:
        got = ops.nvfp4_moe_experts(x, ids, wts, *up, *down, act)
        want = nvfp4_moe_experts_ref(x, ids, wts, *up, *down, act)
    close(got, want)


def test_quantized_ops_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            _, q, s, _ = _fp8_weight(24, 32, False)
            p, s4, s2 = quantize_nvfp4(torch.randn(24, 32))
            self.register_buffer("q", q)
            self.register_buffer("s", s)
            self.register_buffer("p", p)
            self.register_buffer("s4", s4)
            self.register_buffer("s2", s2.expand(24).contiguous())

        def forward(self, x):
            a = ops.fp8_linear(x, self.q, self.s, 32, torch.tensor(0.01), None)
            return a + ops.nvfp4_linear(x, self.p, self.s4, self.s2, None)

    m = M()
    x = torch.randn(5, 32)
    dim = torch.export.Dim("t", min=2, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: dim},), strict=False)
    assert torch.equal(ep.module()(x), m(x))


def _quant_case(kind, act, t, k, e, used, h=48, i=32):
    up = _experts(e, 2 * i if act == "swiglu" else i, h, kind)
    down = _experts(e, h, i, kind)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(used)[:k] for _ in range(t)])  # experts >= used: unused
    wts = torch.rand(t, k)
    scales = (torch.tensor(4.0 / 448), torch.tensor(2.0 / 448)) if kind == "fp8" else ()
    return (x, ids, wts, *up, *down, act, *scales)


def _quant_ref(kind, case):
    return (fp8_moe_experts_ref if kind == "fp8" else nvfp4_moe_experts_ref)(*case)


def _quant_op(kind):
    return ops.fp8_moe_experts if kind == "fp8" else ops.nvfp4_moe_experts


@pytest.mark.parametrize("kind", ("fp8", "nvfp4"))
@pytest.mark.parametrize("act", ("swiglu", "relu2"))
@pytest.mark.parametrize("impl", ("gather", "chunked", "chunked1"))
@pytest.mark.parametrize("shape", [(1, 2, 6, 6), (2, 3, 7, 5), (19, 2, 6, 4), (9, 3, 5, 5)])
def test_quantized_experts_sync_free_ways_match_ref(kind, act, impl, shape, monkeypatch):
    """The GPU ways of the FP8 / NVFP4 experts (ops/quant_moe.py), run on the CPU: against the
    dequantize-everything per-token oracle at T * k both sides of E, unused experts, all
    experts in one chunk and one expert per chunk, with every host sync refused."""
    from specdeploy.ops import quant_moe

    t, k, e, used = shape
    case = _quant_case(kind, act, t, k, e, used)
    want = _quant_ref(kind, case)
    if impl == "chunked1":
        monkeypatch.setattr(quant_moe, "CHUNK_BYTES", 0)  # one expert per chunk (max(1, .))
        impl = "chunked"

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the sync-free quantized MoE path")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
            m.setattr(torch.Tensor, name, refuse)
        got = _quant_op(kind)(*case, impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ("fp8", "nvfp4"))
def test_quantized_experts_chunk_sizes_agree(kind):
    """"chunked" at 1, 2, 4 and all experts per chunk: one answer (fp32 sums of the same
    products; within 1e-6 of each other), equal to the CPU loop within 1e-5."""
    from specdeploy.ops import quant_moe
    from specdeploy.ops.fp8_linear import dequantize_fp8
    from specdeploy.ops.nvfp4_linear import dequantize_nvfp4

    case = _quant_case(kind, "swiglu", 13, 2, 7, 7)
    x, ids, wts, *w = case
    if kind == "fp8":
        uq, us, ub, dq, ds, db, _, s_up, s_down = w
        up = lambda i: dequantize_fp8(uq[i], us[i], ub)  # noqa: E731
        down = lambda i: dequantize_fp8(dq[i], ds[i], db)  # noqa: E731
        sizes = (uq.shape[0], uq.shape[1], dq.shape[2])
    else:
        uq, us, us2, dq, ds, ds2, _ = w
        s_up = s_down = None
        up = lambda i: dequantize_nvfp4(uq[i], us[i], us2[i])  # noqa: E731
        down = lambda i: dequantize_nvfp4(dq[i], ds[i], ds2[i])  # noqa: E731
        sizes = (uq.shape[0], uq.shape[1], 2 * dq.shape[2])
    outs = [quant_moe.quantized_experts_sync_free(x, ids, wts, sizes, up, down, "swiglu", s_up,
                                                  s_down, impl="chunked", chunk=c)
            for c in (1, 2, 4, 7)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0], _quant_op(kind)(*case, impl="loop"), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kind", ("fp8", "nvfp4"))
def test_quantized_experts_gather_rows_are_batch_invariant(kind):
    """"gather" (the decode / verify way): a token's output is bit-identical alone and inside
    the batch, so greedy speculation on a quantized MoE GPU target verifies what it decodes."""
    case = _quant_case(kind, "relu2", 3, 2, 8, 8)
    x, ids, wts, *rest = case
    full = _quant_op(kind)(*case, impl="gather")
    for r in range(3):
        one = _quant_op(kind)(x[r:r + 1], ids[r:r + 1], wts[r:r + 1], *rest, impl="gather")
        assert torch.equal(one[0], full[r]), r


def test_quantized_experts_impl_is_checked():
    case = _quant_case("nvfp4", "relu2", 2, 1, 3, 3)
    with pytest.raises(ValueError, match="impl"):
        ops.nvfp4_moe_experts(*case, impl="grouped")
