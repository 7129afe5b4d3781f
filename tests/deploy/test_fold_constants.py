"""fold_constants: ops on weights alone are computed once (a toy graph: which fold, which stay),
the deployed hybrids' outputs are bit-equal with and without the pass, and drop_identity_ops
drops same-dtype casts of symbolic-shape tensors."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.fold_constants import MAX_NUMEL, fold_constants
from specdeploy.deploy.passes.identity import is_identity

LIMITS = dict(dtype="float32", max_batch_size=2, max_seq_len=64, max_cache_gib=0.01)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a_log = torch.nn.Parameter(torch.randn(8))
        self.conv = torch.nn.Parameter(torch.randn(8, 1, 4))
        self.big = torch.nn.Parameter(torch.randn(300, 300))  # > MAX_NUMEL elements

    def forward(self, x):
        a = -torch.exp(self.a_log)  # folds: exp, neg
        w = self.conv.squeeze(1)  # folds (a view)
        big_t = self.big.t()  # folds (a view: no new memory)
        big_d = self.big.double()  # stays: a copy of more than MAX_NUMEL elements
        y = x * a + w.sum(-1)  # stays: reads the input
        return y, x[:, :1] @ big_t[:1], big_d.sum()


def _calls(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_folds_weight_ops_only():
    assert 300 * 300 > MAX_NUMEL
    from torch.export import export

    x = torch.randn(3, 8)
    gm = export(_Toy(), (x,)).module()
    gm = fx.GraphModule(gm, gm.graph)
    want = gm(x)
    before = _calls(gm)
    done = fold_constants(gm, type("Ctx", (), {"compile": False})())
    after = _calls(gm)
    for op in ("exp", "neg", "squeeze", "aten.t."):
        assert any(op in c for c in before) and not any(op in c for c in after), op
    assert any("_to_copy" in c or "to.dtype" in c for c in after)  # the big cast stays
    assert any("mul" in c for c in after)
    assert done.num_matches >= 4
    got = gm(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    folded = [b for n, b in gm.named_buffers() if n.startswith("_folded")]
    big = gm.big.untyped_storage().data_ptr()  # a view of a weight: no copy kept
    assert any(b.untyped_storage().data_ptr() == big for b in folded)

def test_results_read_by_mutating_ops_are_not_folded():
    """A value an in-place op writes (or a cache passed to a cached op) is never shared."""
    from torch.export import export

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            buf = self.w * 2
            buf.add_(x)  # mutates the weights' product: must stay per step
            return buf

    gm = export(M(), (torch.randn(4),)).module()
    gm = fx.GraphModule(gm, gm.graph)
    x = torch.randn(4)
    want = gm(x)
    fold_constants(gm, type("Ctx", (), {"compile": False})())
    assert torch.equal(gm(x), want) and torch.equal(gm(x), want)  # twice: nothing accumulated


def _steps():
    a, b = list(range(5, 16)), list(range(20, 27))
    yield [Segment(a, 0, [0, 1, 2, 3], 0, num_logits=1), Segment(b, 0, [4, 5, 6], 1)]
    yield [Segment([30], len(a), [0, 1, 2, 3], 0), Segment([31], len(b), [4, 5, 6], 1)]
    yield [Segment([32, 33, 34], len(a) + 1, [0, 1, 2, 3], 0, num_logits=3, kind=SEG_EXTEND)]


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe", "llama"])
@pytest.mark.parametrize("pass_name", ["fold_constants", "call_aten_directly"])
def test_outputs_equal_without_the_pass(tiny_dir, family, pass_name):
    """fold_constants and call_aten_directly (aten calls through tensor methods / narrow) leave
    every logit bit as it was, over prefill, decode and verify steps."""
    from specdeploy.config import SpecConfig

    src = tiny_dir(family)
    spec = SpecConfig("ngram", 2, controller="off")
    on = build(str(src), spec=spec, page_size=4, **LIMITS)
    off = build(str(src), spec=spec, page_size=4, disabled=frozenset({pass_name}), **LIMITS)
    info = {i.name: i for i in on.target.infos}[pass_name]
    if pass_name == "call_aten_directly" or family != "llama":
        assert info.num_matches > 0 and not info.skipped  # -exp(A_log), conv weights' views
    if pass_name == "call_aten_directly":
        left = {str(n.target) for n in on.target.gm.graph.nodes if n.op == "call_function"}
        assert not {"aten.view.default", "aten.reshape.default"} & left, left
    for segs in _steps():
        meta = build_metadata(segs)
        assert torch.equal(on.forward(meta).logits, off.forward(meta).logits)


def test_same_dtype_casts_of_symbolic_shapes_are_identities():
    from torch.export import Dim, export

    class M(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float32) + 1, x.to(torch.float64)

    gm = export(M(), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("t")},)).module()
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and "to" in str(n.target)]
    assert [is_identity(n) for n in casts] == [True, False]
