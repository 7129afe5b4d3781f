"""The transform contract (DESIGN.md invariant 5) is enforced by the pipeline, not by each pass:
skips are recorded with their reason, a transform that must match and finds nothing fails, the
graph is cleaned and linted after every transform, declared resources and a compiled program
come back in the result, and the registry cannot drift from the visible `PIPELINE` order."""
from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import fx

from specdeploy.cli import main
from specdeploy.deploy import pipeline
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.pipeline import (
    Done,
    Skipped,
    Stage,
    Transform,
    TransformError,
    run_transform,
    transforms,
)


def _graph() -> fx.GraphModule:
    class M(torch.nn.Module):
        def forward(self, x):
            return x + 1

    return fx.symbolic_trace(M())


def _adds_dead_node(gm, ctx):
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        gm.graph.call_function(operator.mul, (x, 2))  # unused: the pipeline removes it
    return Done(1, "added", bytes_saved=7, resources=("r",))


def test_skip_reasons_are_recorded():
    t = Transform("t", Stage.OPTIMIZE, _adds_dead_node, skip_if=lambda ctx: "not today")
    info, done = run_transform(t, _graph(), DeployContext(model=None))
    assert (info.skipped, info.detail, info.num_matches, done.resources) == (True, "not today",
                                                                          0, ())
    t = Transform("t", Stage.OPTIMIZE, lambda gm, ctx: Skipped("found no blocks"))
    assert run_transform(t, _graph(), DeployContext(model=None))[0].detail == "found no blocks"
    t = Transform("t", Stage.OPTIMIZE, _adds_dead_node)
    info, _ = run_transform(t, _graph(), DeployContext(model=None, disabled=frozenset({"t"})))
    assert info.skipped and info.detail == "disabled"


def test_the_pipeline_cleans_and_lints_after_a_transform():
    gm = _graph()
    info, done = run_transform(Transform("t", Stage.OPTIMIZE, _adds_dead_node), gm,
                               DeployContext(model=None))
    assert not any(n.target is operator.mul for n in gm.graph.nodes)
    assert (info.num_matches, info.detail, info.bytes_saved, done.resources) == (1, "added", 7,
                                                                               ("r",))
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0))  # recompiled


def test_required_match_missing_fails_loudly():
    t = Transform("needs", Stage.PATTERN, lambda gm, ctx: Done(0), requires_match=True)
    with pytest.raises(TransformError, match="needs: matched nothing"):
        run_transform(t, _graph(), DeployContext(model=None))


def test_registry_must_equal_pipeline(monkeypatch):
    monkeypatch.setitem(pipeline._REGISTRY, "stray", Transform("stray", Stage.CACHE, None))
    with pytest.raises(TransformError, match="PIPELINE"):
        transforms()


def test_stages_in_order_and_optimize_apart_from_compile():
    items = transforms()
    assert [t.stage for t in items] == sorted(t.stage for t in items)
    stage = {t.name: t.stage for t in items}
    for name in ("ggml_linears", "fuse_parallel_linears", "pack_linear_weights",
                 "fuse_row_ops", "fuse_rope_attention"):
        assert stage[name] == Stage.OPTIMIZE
    assert {n for n, s in stage.items() if s == Stage.COMPILE} == {
        "fold_constants", "call_kernels_directly", "flatten_attrs", "fuse_recurrent_mixers",
        "fuse_moe_blocks", "fuse_decoder_layers", "fuse_leftover_rows", "drop_identity_ops",
        "call_aten_directly", "compile_model"}


def test_list_transforms_shows_each_skip_reason_once(tiny_dir, capsys):
    from specdeploy.deploy.build import build

    path = str(tiny_dir("llama"))
    rc = main(["deploy", "--model", path, "--list-transforms", "--max-seq-len", "64",
               "--max-cache-gib", "0.01", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = re.findall(r"^\s+\d+\. \w+\s+(\w+)\s+(skipped|\d+ matches)(?:  \[(.*)\])?$", out,
                      re.M)
    infos = build(path, dtype="float32", max_seq_len=64, max_cache_gib=0.01).infos
    assert [r[0] for r in rows] == [i.name for i in infos] == [t.name for t in transforms()]
    for (_, state, detail), info in zip(rows, infos):
        if info.skipped:
            assert state == "skipped" and detail == info.detail and detail
            assert out.count(detail) == 1, detail
    skipped = {r[0]: r[2] for r in rows if r[1] == "skipped"}
    assert skipped["compile_model"] == "compile=False"
    assert skipped["quantize_int8_weights"] == "quantize=None"
