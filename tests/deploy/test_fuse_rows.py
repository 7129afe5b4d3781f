"""fuse_row_ops: the fused graph equals the unfused one; each fused op equals its ref."""
from __future__ import annotations

import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models.registry import family_module
from specdeploy.ops.fused_rows import add_rms_norm_ref, silu_mul_ref

LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)


def _run(deployed, ids):
    meta = build_metadata([Segment(ids, 0, list(range(16)), 0, num_logits=len(ids))])
    return deployed.forward(meta).logits


def _count(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and name in getattr(n.target, "__name__", str(n.target)))


def test_fused_graph_equals_unfused_and_counts(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    ids = list(range(5, 26))
    fused = build(str(tmp_path), **LIMITS)
    info = {i.name: i for i in fused.infos}["fuse_row_ops"]
    # 2 layers: 2 residual adds before a norm each (the last feeds the final norm), 1 SwiGLU each
    assert info.num_matches == 6 and "4 add+rms_norm, 2 silu*mul" in info.detail
    assert _count(fused.gm, "silu") == 2 and _count(fused.gm, "add_rms_norm") == 4
    base = build(model=load_model(str(tmp_path)), disabled=frozenset({"fuse_row_ops"}), **LIMITS)
    assert _count(base.gm, "add_rms_norm") == 0
    # the norm's sum of squares may round differently in its last bit: fp32 1e-5
    torch.testing.assert_close(_run(fused, ids), _run(base, ids), rtol=1e-5, atol=1e-5)


def test_fused_ops_equal_refs_at_odd_shapes():
    g = torch.Generator().manual_seed(0)
    for rows, n in ((1, 7), (3, 64), (70, 100)):
        a, b = torch.randn(1, rows, n, generator=g), torch.randn(1, rows, n, generator=g)
        w = torch.randn(n, generator=g)
        s, y = torch.ops.specdeploy.add_rms_norm(a, b, w, 1e-6)
        rs, ry = add_rms_norm_ref(a, b, w, 1e-6)
        assert torch.equal(s, rs)  # the sum rounds as torch's add
        torch.testing.assert_close(y, ry, rtol=1e-6, atol=1e-6)
        x = torch.randn(1, rows, 2 * n + 3, generator=g) * 4  # wider than 2n: a fused row
        out = torch.ops.specdeploy.silu_mul(x, n)
        # expf vs torch's vectorized exp: a few ulps
        torch.testing.assert_close(out, silu_mul_ref(x, n), rtol=2e-6, atol=1e-6)
        for i in range(rows):  # row-wise: a row alone gives the same bits
            assert torch.equal(torch.ops.specdeploy.silu_mul(x[:, i:i + 1], n), out[:, i:i + 1])
