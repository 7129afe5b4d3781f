"""pack_linear_weights: oneDNN-packed fp32 linears give F.linear's outputs, every linear of a
deployed model is packed, and the deployed logits match the unpacked deployment."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.pack_linears import packed_linear_fn
from specdeploy.loading import load_model
from specdeploy.models.registry import family_module

LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """One row runs as a GEMV on one thread and on the packed weight on more."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (4, 48), (2, 3, 48), (7, 48), (300, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(shape, bias, threads):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    out = packed_linear_fn(w, b)(x)
    assert out.shape == (*shape[:-1], 40)
    # fp32, different blocking of the same dot products: 1e-5 relative to the output scale
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * 48**0.5)


def test_tiny_weights_are_left_alone(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    info = {i.name: i for i in build(str(tmp_path), **LIMITS).infos}
    assert info["pack_linear_weights"].num_matches == 0


def test_deployed_logits_match_unpacked(tmp_path, monkeypatch):
    monkeypatch.setattr("specdeploy.deploy.passes.pack_linears.MIN_ELEMENTS", 0)
    family_module("llama").make_tiny(tmp_path, seed=0)
    packed = build(str(tmp_path), **LIMITS)
    info = {i.name: i for i in packed.infos}["pack_linear_weights"]
    model = load_model(str(tmp_path))
    base = build(model=model, disabled=frozenset({"pack_linear_weights"}), **LIMITS)
    linears = [n for n in base.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert info.num_matches == len(linears) > 0, info
    assert not any(n.target is torch.ops.aten.linear.default for n in packed.gm.graph.nodes)
    for n in (1, 4, 8, 21):  # decode, verify-sized steps (skinny, packed), a prefill
        ids = list(range(5, 5 + n))
        meta = build_metadata([Segment(ids, 0, list(range(16)), 0, num_logits=n)])
        a, b = packed.forward(meta).logits, base.forward(meta).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_build_deployed_can_disable_the_pass(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    dep = build(str(tmp_path), disabled=frozenset({"pack_linear_weights"}), **LIMITS)
    info = {i.name: i for i in dep.infos}["pack_linear_weights"]
    assert info.skipped and info.detail == "disabled"


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48)])
def test_one_row_without_pack_equals_linear(shape, threads):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(40, 48, generator=g), torch.randn(40, generator=g), torch.randn(
        *shape, generator=g)
    torch.testing.assert_close(packed_linear_fn(w, b, pack=False)(x), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5 * 48**0.5)


def test_without_pack_the_wide_path_is_plain_linear():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 48, generator=g), torch.randn(9, 48, generator=g)
    torch.testing.assert_close(packed_linear_fn(w, None, pack=False)(x), F.linear(x, w),
                               rtol=0, atol=0)
