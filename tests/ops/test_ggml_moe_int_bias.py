"""gpt-oss's experts (biases, the clamped SwiGLU) in ops/ggml_moe_int.py's one C call, and
row_kernels.c's clamped SwiGLU it calls.

Oracles: torch's `clamped_swiglu` (ops/moe_bias.py) for the C activation: within 1e-6 relative
(its sigmoid's exp is a polynomial, relative error < 2e-7; measured 4.4e-7), 1e-30 absolute
where the result underflows; the layer composed in Python from ggml_linear_int calls (checked
against exact math in tests/ops/test_ggml_int.py), `+ bias` and that activation: bit for bit;
the fp32 `moe_experts_bias_ref` on the blocks' values: 8-bit activations, 2e-2 of the largest
output (measured 1.2e-2). Then thread counts, each token alone and other batches: the same bits.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import ggml_int, ggml_tiled, row_kernels
from specdeploy.ops import ggml_moe_int as gm
from specdeploy.ops.ggml_linear import dequantize, expert
from specdeploy.ops.moe_bias import clamped_swiglu, moe_experts_bias_ref

pytest.importorskip("gguf")
from tests.ops.test_ggml_moe_int import E, _inputs, _layer  # noqa: E402

pytestmark = pytest.mark.skipif(gm.unavailable() is not None,
                                reason=f"one-call MoE kernel unavailable: {gm.unavailable()}")
ALPHA, LIMIT = 1.702, 7.0


def _biases(h: int = 256, inter: int = 256):
    g = torch.Generator().manual_seed(9)
    return torch.randn(E, 2 * inter, generator=g), 0.1 * torch.randn(E, h, generator=g)


def _x(tokens: int, seed: int = 0):
    x, ids, wts = _inputs(tokens, 256, seed)
    return 4 * x, ids, wts  # up rows of ~6: the clamps at +-7 bite


def test_c_activation_matches_torch():
    g = torch.Generator().manual_seed(1)
    h = 8 * torch.randn(37, 2 * 1003, generator=g)  # odd widths: the vector loops' tails
    h[0, :3] = torch.tensor([-200.0, 7.0, float("nan")])
    h[1, 1003:1005] = torch.tensor([float("nan"), -9.0])
    got = row_kernels.swiglu_oai(h, ALPHA, LIMIT)
    want = clamped_swiglu(h, ALPHA, LIMIT)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)
    assert not torch.equal(got.nan_to_num(), want.nan_to_num())  # (the guard: not torch's)
    for r in (0, 5, 36):  # a row alone: its bits in the batch
        assert torch.equal(row_kernels.swiglu_oai(h[r:r + 1], ALPHA, LIMIT)[0], got[r],
                           ) or got[r].isnan().any()


def _composed(x, ids, wts, up, down, b_up, b_down, linear):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            hu = linear(x[t:t + 1], expert(up, e)) + b_up[e]
            a = row_kernels.swiglu_oai(hu, ALPHA, LIMIT)
            y = linear(a, expert(down, e)) + b_down[e]
            out[t] = out[t] + y[0] * wts[t, j]
    return out


def _int(x, w):
    return ggml_int.ggml_linear_int(x, w, isa=ggml_int.default_isa())


def _tiled(x, w):
    return ggml_tiled.tiled_linear(x, ggml_tiled.repack(w), None, ggml_int.default_isa())


@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_1")])
@pytest.mark.parametrize("tiled", [False, True])
def test_one_call_equals_the_composed_layer_bit_for_bit(kinds, tiled):
    up, down = _layer(kinds, "swiglu")
    b_up, b_down = _biases()
    x, ids, wts = _x(24, seed=4)
    fn = gm.bound_experts(up, down, "swiglu_oai", ggml_int.default_isa(), tiled=tiled,
                          b_up=b_up, b_down=b_down, alpha=ALPHA, limit=LIMIT)
    got = fn(x, ids, wts)
    assert torch.equal(got, _composed(x, ids, wts, up, down, b_up, b_down,
                                      _tiled if tiled else _int))
    # and the fp32 experts on the blocks' values: 8-bit activations move it a little
    w_up = torch.stack([dequantize(expert(up, e)) for e in range(E)])
    w_down = torch.stack([dequantize(expert(down, e)) for e in range(E)])
    ref = moe_experts_bias_ref(x, ids, wts, w_up, b_up, w_down, b_down, "swiglu_oai", ALPHA,
                               LIMIT)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 1e-7 < err < 2e-2, err


@pytest.mark.parametrize("tiled", [False, True])
def test_thread_and_batch_invariant(tiled):
    up, down = _layer(("q8_0", "q8_0"), "swiglu")
    b_up, b_down = _biases()
    x, ids, wts = _x(20, seed=3)
    ys, threads = {}, torch.get_num_threads()
    try:
        for isa in ggml_int.supported_isas():
            fn = gm.bound_experts(up, down, "swiglu_oai", isa, tiled=tiled, b_up=b_up,
                                  b_down=b_down, alpha=ALPHA, limit=LIMIT)
            for n in (1, 2):
                torch.set_num_threads(n)
                ys[(isa, n)] = fn(x, ids, wts)
    finally:
        torch.set_num_threads(threads)
    first = ys[(ggml_int.default_isa(), threads if threads <= 2 else 2)]
    for key, y in ys.items():
        if tiled and key[0] != ggml_int.default_isa():
            continue  # (the tiled kernels' ISAs sum in their own orders)
        assert torch.equal(y, first), key
    for t in range(x.shape[0]):  # each token alone: its row of the batch
        assert torch.equal(fn(x[t:t + 1], ids[t:t + 1], wts[t:t + 1])[0], ys[key][t]), t
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(5))
    assert torch.equal(fn(x[perm], ids[perm], wts[perm]), ys[key][perm])


def test_experts_bias_fn_takes_the_one_call(monkeypatch):
    """deploy/passes/ggml_experts.py: "fast" is one C call; the per-expert loop it replaces gives
    the same bits where the call runs the blocks as stored (untiled)."""
    from specdeploy.deploy.passes.ggml_experts import experts_bias_fn

    up, down = _layer(("q8_0", "q8_0"), "swiglu")
    b_up, b_down = _biases()
    x, ids, wts = _x(12, seed=6)
    isa = ggml_int.default_isa()
    one = experts_bias_fn(up, b_up, down, b_down, "swiglu_oai", ALPHA, LIMIT, isa)
    assert one.__name__ == "experts_one_call"
    monkeypatch.setattr(gm, "tiles", lambda *a: False)
    untiled = experts_bias_fn(up, b_up, down, b_down, "swiglu_oai", ALPHA, LIMIT, isa)
    monkeypatch.setattr(gm, "unavailable", lambda: "off")
    loop = experts_bias_fn(up, b_up, down, b_down, "swiglu_oai", ALPHA, LIMIT, isa)
    assert loop.__name__ == "experts_bias_on_blocks"
    assert torch.equal(untiled(x, ids, wts), loop(x, ids, wts))
    torch.testing.assert_close(one(x, ids, wts), loop(x, ids, wts), rtol=1e-3, atol=1e-3)


def test_bad_biases_are_named():
    up, down = _layer(("q8_0", "q8_0"), "swiglu")
    b_up, b_down = _biases()
    with pytest.raises(ValueError, match="expert biases"):
        gm.bound_experts(up, down, "swiglu_oai", "scalar", b_up=b_up[:, :10], b_down=b_down)
