"""MXFP4 experts (gpt-oss) in ops/ggml_moe_int.py's one C call and in the per-expert loop of
deploy/passes/ggml_experts.py, and the kinds that have no MXFP4 kernel refusing it by name.

Oracles: the same values as Q8_0 blocks (tests/ops/test_ggml_mxfp4.py's own table) through the
same call: bit for bit (the tiled kernels' integer products and scales are the same numbers);
the per-expert loop on per-expert tiled calls: the one call's bits (as for Q8_0 untiled, in
tests/ops/test_ggml_moe_int_bias.py); the exact kernel for a "fast" linear that cannot tile.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.ops import ggml_int
from specdeploy.ops import ggml_moe_int as gm
from specdeploy.ops.ggml_linear import ggml_linear, make_weight

pytest.importorskip("gguf")
from tests.ops.test_ggml_moe_int import E, _inputs  # noqa: E402
from tests.ops.test_ggml_mxfp4 import _as_q8_0, _raw  # noqa: E402

pytestmark = pytest.mark.skipif(gm.unavailable() is not None,
                                reason=f"one-call MoE kernel unavailable: {gm.unavailable()}")
ALPHA, LIMIT = 1.702, 7.0
H, INTER = 96, 160  # 3 and 5 blocks; outputs 320 / 96: tiles of 16


def _stacked(n: int, k: int, seed: int, q8_0: bool = False):
    raw = _raw(E * n, k, range(112, 136), seed=seed)
    kind = "q8_0" if q8_0 else "mxfp4"
    raw = _as_q8_0(raw) if q8_0 else raw
    return make_weight(kind, torch.from_numpy(raw).view(E, n, -1), (E, n, k))


def _layer(q8_0: bool = False):
    return _stacked(2 * INTER, H, 1, q8_0), _stacked(H, INTER, 2, q8_0)


def _biases():
    g = torch.Generator().manual_seed(9)
    return torch.randn(E, 2 * INTER, generator=g), 0.1 * torch.randn(E, H, generator=g)


@pytest.mark.parametrize("isa", ggml_int.supported_isas())
@pytest.mark.parametrize("bias", [False, True])
def test_one_call_equals_the_q8_0_copys_bits(isa, bias):
    x, ids, wts = _inputs(11, H, seed=3)
    kw = dict(zip(("b_up", "b_down"), _biases()), alpha=ALPHA, limit=LIMIT) if bias else {}
    act = "swiglu_oai" if bias else "swiglu"
    got = gm.bound_experts(*_layer(), act, isa, **kw)(4 * x, ids, wts)
    want = gm.bound_experts(*_layer(q8_0=True), act, isa, **kw)(4 * x, ids, wts)
    assert torch.equal(got, want) and got.abs().max() > 0
    for t in (0, 10):  # a token alone: its row of the batch
        one = gm.bound_experts(*_layer(), act, isa, **kw)(4 * x[t:t + 1], ids[t:t + 1],
                                                          wts[t:t + 1])
        assert torch.equal(one[0], got[t])


def test_the_per_expert_loop_gives_the_one_calls_bits(monkeypatch):
    from specdeploy.deploy.passes.ggml_experts import experts_bias_fn

    up, down = _layer()
    b_up, b_down = _biases()
    x, ids, wts = _inputs(9, H, seed=6)
    isa = ggml_int.default_isa()
    one = experts_bias_fn(up, b_up, down, b_down, "swiglu_oai", ALPHA, LIMIT, isa)
    assert one.__name__ == "experts_one_call"
    monkeypatch.setattr(gm, "unavailable", lambda: "off")
    loop = experts_bias_fn(up, b_up, down, b_down, "swiglu_oai", ALPHA, LIMIT, isa)
    assert loop.__name__ == "experts_bias_on_blocks"
    assert torch.equal(loop(4 * x, ids, wts), one(4 * x, ids, wts))


def test_kernels_without_mxfp4_refuse_it_by_name():
    up, down = _layer()
    isa = ggml_int.default_isa()
    with pytest.raises(ValueError, match="mxfp4 experts run only tiled"):
        gm.bound_experts(up, down, "swiglu", isa, tiled=False)
    w = make_weight("mxfp4", up.blocks[0], tuple(up.shape[1:]))
    with pytest.raises(ValueError, match="no per-output integer kernel for mxfp4"):
        ggml_int.ggml_linear_int(torch.randn(2, H), w, isa=isa)
    with pytest.raises(ValueError, match="no per-output integer kernel for mxfp4"):
        ggml_int.bound_linear(w, None, isa)


def test_a_fast_linear_that_cannot_tile_takes_the_exact_kernel():
    from specdeploy.deploy.passes.ggml_calls import ggml_linear_fn

    raw = _raw(40, H, range(112, 136), seed=4)  # 40 outputs: not in 16s
    w = make_weight("mxfp4", torch.from_numpy(raw), (40, H))
    b = torch.randn(40)
    fn = ggml_linear_fn(w, [w], b, ggml_int.default_isa())
    x = torch.randn(20, H)  # above MAX_ROWS too: still the exact kernel (batch invariance)
    assert torch.equal(fn(x), ggml_linear(x, w, b))
    assert torch.equal(fn(x[:1]), fn(x)[:1])
