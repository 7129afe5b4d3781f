"""deploy/export_cache.py: a cached graph is the graph torch.export makes, bound to the new
model's own tensors; anything the trace could read differently misses.

Oracle: a fresh torch.export of the same model (the cache switched off) and the model's eager
forward; fp32 outputs compared exactly (the same ops on the same tensors).
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.deploy import export_cache
from specdeploy.deploy.export import export_model
from specdeploy.loading import load_model
from specdeploy.models import llama


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_cache")
    a = llama.make_tiny(root / "a", seed=0)
    b = llama.make_tiny(root / "b", seed=1)  # the same structure, other weights
    c = llama.make_tiny(root / "c", seed=0, config_overrides=dict(rms_norm_eps=1e-3))
    return a, b, c


def _inputs():
    return torch.tensor([[5, 9, 2, 7, 1]]), torch.arange(5)[None]


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(export_cache, "_GRAPHS", {})
    monkeypatch.setenv("SPECDEPLOY_EXPORT_CACHE", "1")
    return export_cache._GRAPHS


def test_a_hit_is_the_fresh_export_bound_to_the_new_weights(ckpts, fresh_cache, monkeypatch):
    a, b, _ = ckpts
    export_model(load_model(a))
    assert len(fresh_cache) == 1
    model = load_model(b)
    hit = export_model(model)
    assert len(fresh_cache) == 1  # reused, not stored again
    monkeypatch.setenv("SPECDEPLOY_EXPORT_CACHE", "0")
    fresh = export_model(load_model(b))
    assert hit.code == fresh.code
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    bound = [n.target for n in hit.graph.nodes if n.op == "get_attr" and n.target in named]
    assert bound and all(export_cache._resolve(hit, t) is named[t] for t in bound)
    x = _inputs()
    with torch.no_grad():
        got, want, eager = hit(*x)[0], fresh(*x)[0], model(*x)
        other = export_model(load_model(a))(*x)[0]
    assert torch.equal(got, want)
    assert torch.equal(got, eager)
    assert not torch.equal(got, other)  # a's weights would give other logits


def test_what_the_trace_reads_is_in_the_key(ckpts, fresh_cache):
    a, _, c = ckpts
    m = load_model(a)
    key = export_cache.fingerprint(m, (8,))
    assert export_cache.fingerprint(load_model(a), (8,)) == key
    assert export_cache.fingerprint(load_model(c), (8,)) != key  # a config value
    assert export_cache.fingerprint(m, (9,)) != key  # the export arguments
    assert export_cache.fingerprint(load_model(a, dtype=torch.bfloat16), (8,)) != key
    m.model.norm.register_forward_hook(lambda *a: None)
    assert export_cache.fingerprint(m, (8,)) is None  # a hook: never cached
    m2 = load_model(a)
    m2.model.norm.note = object()  # an attribute without a value repr
    assert export_cache.fingerprint(m2, (8,)) is None


def test_other_config_and_drafter_inputs_miss(ckpts, fresh_cache):
    a, _, c = ckpts
    export_model(load_model(a))
    x = _inputs()
    model = load_model(c)
    with torch.no_grad():
        assert torch.equal(export_model(model)(*x)[0], model(*x))
    assert len(fresh_cache) == 2


def test_off_by_default(ckpts, fresh_cache, monkeypatch):
    monkeypatch.delenv("SPECDEPLOY_EXPORT_CACHE")
    export_model(load_model(ckpts[0]))
    assert not fresh_cache


def test_check_mode_names_a_hit_that_differs(ckpts, fresh_cache, monkeypatch):
    """`SPECDEPLOY_EXPORT_CACHE=check` exports anyway and compares each hit with the fresh
    graph: an honest hit passes; an entry holding another structure's graph (here: another
    norm eps, a constant in the code) fails, naming it."""
    a, b, c = ckpts
    monkeypatch.setenv("SPECDEPLOY_EXPORT_CACHE", "check")
    export_model(load_model(c))
    (other,) = fresh_cache
    export_model(load_model(a))
    export_model(load_model(b))  # an honest hit
    (key,) = set(fresh_cache) - {other}
    fresh_cache[key] = fresh_cache[other]
    with pytest.raises(RuntimeError, match="a hit differs from the fresh export: the graphs' "
                                           "code differs"):
        export_model(load_model(b))


def test_one_entry_serves_with_and_without_the_sharding_hints(ckpts, fresh_cache, monkeypatch):
    """An entry keeps the sharding hints: a one-process export (hints dropped) and a ranked
    one (hints kept for the shard transform) of one structure share it, and each is what a
    fresh export of its kind is."""
    a, b, _ = ckpts
    plain = export_model(load_model(a))
    hinted = export_model(load_model(b), keep_hints=True)
    again = export_model(load_model(b))
    assert len(fresh_cache) == 1
    monkeypatch.setenv("SPECDEPLOY_EXPORT_CACHE", "0")
    assert hinted.code == export_model(load_model(b), keep_hints=True).code
    assert again.code == plain.code == export_model(load_model(b)).code
    assert hinted.code != plain.code
