"""compile=True: the transformed graph runs through torch.compile (inductor) and gives the
uncompiled deployment's logits (oracle: the same deployment without compile)."""
from __future__ import annotations

import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.models.registry import family_module
from tests.deploy.conftest import assert_close

LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)


def test_compiled_deployment_matches_uncompiled(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    compiled = build(str(tmp_path), compile=True, **LIMITS)
    plain = build(str(tmp_path), **LIMITS)
    info = {i.name: i for i in compiled.infos}["compile_model"]
    assert info.num_matches == 1 and not info.skipped
    pages = list(range(16))
    ids = list(range(5, 25))
    steps = [Segment(ids[:12], 0, pages, 0, 12), Segment(ids[12:13], 12, pages, 0, 1),
             Segment(ids[13:17], 13, pages, 0, 4, SEG_EXTEND)]
    for seg in steps:  # prefill, decode, verify: the same cache contents on both sides
        meta = build_metadata([seg])
        with torch.no_grad():
            assert_close(compiled.forward(meta).logits, plain.forward(meta).logits, rtol=1e-5)
