"""fuse_parallel_linears: same outputs, expected match count, weights alias the fused tensor."""
from __future__ import annotations

import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models.registry import family_module

LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)


def _run(deployed, ids):
    meta = build_metadata([Segment(ids, 0, list(range(16)), 0, num_logits=len(ids))])
    return deployed.forward(meta).logits


def test_fused_equals_unfused_and_counts(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    ids = list(range(5, 26))
    plain = build(str(tmp_path), **LIMITS)
    fused_info = {i.name: i for i in plain.infos}["fuse_parallel_linears"]
    # q/k/v and gate/up in each of the 2 layers
    assert fused_info.num_matches == 4
    assert "10 linears into 4" in fused_info.detail
    model = load_model(str(tmp_path))
    base = build(model=model, disabled=frozenset({"fuse_parallel_linears"}), **LIMITS)
    torch.testing.assert_close(_run(plain, ids), _run(base, ids), rtol=1e-5, atol=1e-5)
    names = {n for n, _ in plain.gm.named_buffers()}
    assert {"fused_linear_0", "fused_linear_3"} <= names
