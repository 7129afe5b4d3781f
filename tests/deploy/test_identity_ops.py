"""drop_identity_ops: only provable no-ops go (casts to the same dtype/device, alias, views to
the same static shape), outputs are bit-equal with and without the pass on tiny deployments
(a llama target with its EAGLE-3 drafter, exact and fast kernels), and cache buffers read as
plain attributes are the registered buffers themselves."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.identity import drop_identity_ops, is_identity

LIMITS = dict(dtype="float32", max_batch_size=2, max_seq_len=64, page_size=4,
              max_cache_gib=0.01)
OFF = frozenset({"drop_identity_ops"})


def _traced(fn, *example):
    from torch.export import export

    class M(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    return export(M(), example).module()


def test_only_no_ops_are_identities():
    x = torch.randn(2, 3)

    def f(x):
        a = x.to(torch.float32)  # no-op
        b = x.to(torch.float64)  # a cast
        c = x.to(torch.float32, copy=True)  # a copy
        d = torch.ops.aten.alias.default(x)
        e = x.reshape(2, 3)  # same shape
        g = x.reshape(3, 2)
        return a + 1, b + 1, c + 1, d + 1, e + 1, g + 1

    gm = _traced(f, x)
    gm = fx.GraphModule(gm, gm.graph)
    kept = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and not is_identity(n)}
    dropped = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
               and is_identity(n)]
    assert len(dropped) >= 2 and not any("float64" in d for d in dropped)
    want = gm(x)
    done = drop_identity_ops(gm, None)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert done.num_matches == len(dropped)
    assert all(torch.equal(a, b) for a, b in zip(gm(x), want))
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert left <= kept  # nothing but the dropped nodes went


def _steps():
    a, b = list(range(5, 16)), list(range(20, 27))
    yield [Segment(a, 0, [0, 1, 2, 3], 0, num_logits=1), Segment(b, 0, [4, 5, 6], 1)]
    yield [Segment([30], len(a), [0, 1, 2, 3], 0), Segment([31], len(b), [4, 5, 6], 1)]
    yield [Segment([32, 33, 34], len(a) + 1, [0, 1, 2, 3], 0, num_logits=3, kind=SEG_EXTEND)]


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_outputs_equal_without_the_pass(tiny_dir, tmp_path, kernels):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    src = tiny_dir("llama")
    spec = SpecConfig("eagle3", 2, draft_model=str(make_tiny_eagle3(src, tmp_path / "e3")),
                      controller="off")
    on = build(str(src), spec=spec, kernels=kernels, **LIMITS)
    off = build(str(src), spec=spec, kernels=kernels, disabled=OFF, **LIMITS)
    info = {i.name: i for i in on.draft.infos}["drop_identity_ops"]
    assert info.num_matches > 0 and not info.skipped  # the drafter's fp32 -> fp32 casts
    assert not [n for n in on.draft.gm.graph.nodes if is_identity(n)]
    g = torch.Generator().manual_seed(0)
    for segs in _steps():
        meta = build_metadata(segs)
        got, want = on.target.forward(meta), off.target.forward(meta)
        assert torch.equal(got.logits, want.logits)
        hidden = torch.randn(meta.num_tokens, on.drafter.cfg.hidden_size, generator=g)
        got, want = on.draft.forward(meta, hidden), off.draft.forward(meta, hidden)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden)
    for dep in (on.target, on.draft):  # plain attributes: the buffers themselves
        bufs = dict(dep.gm.named_buffers())
        for h in dep.resources:
            for name in (f"{h.name}_k", f"{h.name}_v", h.name):
                if name in bufs:
                    assert dep.gm.__dict__[name] is bufs[name], name
