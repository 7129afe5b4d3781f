"""A weight whose stored columns are reordered within K-quant blocks (a Qwen3.5 GGUF's `ssm_out`,
`GGMLWeight.gather`) on the tiled kernel: x's columns taken in stored order, then the copy.

Oracles: gguf-py's dequantization (through `dequantize`, gather applied) and a float64 matmul
within the 8-bit activation bound; the tiled kernel on the copy with x's columns reordered by
hand, bit for bit; the copy's rows as the weight's values (`member_rows`, gather undone)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_tiled
from specdeploy.ops.ggml_linear import dequantize, make_weight
from specdeploy.ops.ggml_tiled import TiledMember, member_rows, repack, tiled_linear_fn

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import random_kquant  # noqa: E402

pytestmark = pytest.mark.skipif(ggml_tiled.kernel_unavailable() is not None,
                                reason=f"tiled kernel: {ggml_tiled.kernel_unavailable()}")


def _reordered(kind: str, n: int, k: int, head: int, seed: int):
    """Blocks of `kind` whose columns are value heads of `head` stored in another head order
    (a K-quant block spans several heads: no whole-block move), and the columns' order."""
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(random_kquant(getattr(gguf.GGMLQuantizationType, kind.upper()),
                                         (n, k), rng).reshape(n, -1).copy())
    heads = torch.from_numpy(rng.permutation(k // head))
    cols = (heads[:, None] * head + torch.arange(head)).reshape(-1)
    return make_weight(kind, raw, (n, k), cols)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q5_k"])
def test_gathered_columns_run_tiled(kind):
    gw = _reordered(kind, 48, 512, 64, seed=1)
    assert gw.gather is not None and not torch.equal(gw.gather, torch.arange(512))
    tw = repack(gw)
    fn = tiled_linear_fn(tw, None, "avx2" if "avx2" in ggml_tiled.supported_isas() else "scalar",
                         gw.gather)
    assert not hasattr(fn, "tiled_call")  # a fused caller would skip the reorder
    w = dequantize(gw).double()
    for rows in (1, 3, 37):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        y = fn(x)
        by_hand = ggml_tiled.tiled_linear(x[:, gw.gather].contiguous(), tw)
        assert torch.equal(y, by_hand)
        want = x.double() @ w.t()
        # 8-bit activations per 32 values: |err| <= sum over blocks of (d_x / 2) |w|
        d_x = x.abs().view(rows, -1, 32).amax(-1) / 127
        bound = ((d_x / 2).repeat_interleave(32, 1).double() @ w.abs().t()) * 1.01 + 1e-6
        assert ((y.double() - want).abs() <= bound).all()
    member = TiledMember(tw, 0, gw.shape, gw.gather)
    assert torch.equal(member_rows(member), dequantize(gw))
    out = torch.empty(3, 512)
    ids = torch.tensor([0, 17, 47])
    assert torch.equal(member_rows(member, ids, out=out), dequantize(gw)[ids])
    assert torch.equal(out, dequantize(gw)[ids])
