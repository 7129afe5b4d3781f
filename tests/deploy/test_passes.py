"""Each transform of the pipeline, on tiny llama / nemotron_h / qwen3_5_moe: the graph computes the
same outputs before and after it, and its match count is what the model's structure says.

The pipeline is walked one transform at a time on one exported graph per family. Before the cache
stage a graph is run on (input_ids, position_ids[, logits_idx]); from the first cached op on, the
graph is run as a single fresh prefill segment (caches allocated, nothing cached yet), which must
give the logits of the uncached graph. A final test runs the transformed program over chunked
prefill, decode and ragged steps and compares with the plain model on each full sequence.
"""
from __future__ import annotations

import math

import pytest
import torch

from specdeploy.cache.metadata import Segment, build_metadata, kv_slot_mapping
from specdeploy.cache.plan import plan_cache
from specdeploy.deploy.build import allocate, name_inputs
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.graph import placeholders
from specdeploy.deploy.pipeline import Stage, run_transform, transforms
from specdeploy.deploy.runner import GraphDeployed
from specdeploy.loading import load_model

T = 11
PAGE_SIZE = 5
FAMILIES = ("llama", "nemotron_h", "qwen3_5_moe")
EXACT = 1e-6  # same kernels in the same order: only fp32 reassociation noise allowed


def expected_counts(family: str, hf: dict) -> dict[str, int]:
    if family == "llama":
        attn, ssm, conv, gdn = hf["num_hidden_layers"], 0, 0, 0
    elif family == "nemotron_h":
        pattern = hf["hybrid_override_pattern"]
        attn, ssm, conv, gdn = pattern.count("*"), pattern.count("M"), pattern.count("M"), 0
    else:
        types = hf["text_config"]["layer_types"]
        linear = types.count("linear_attention")
        attn, ssm, conv, gdn = types.count("full_attention"), 0, linear, linear
    return {"insert_cached_attention": attn, "insert_cached_ssm": ssm,
            "insert_cached_conv": conv, "insert_cached_gdn": gdn, "gather_logits": 1}


def run_graph(gm, ids: torch.Tensor, logits_idx: torch.Tensor | None = None):
    """Run any stage's graph on one sequence: a single fresh prefill segment."""
    t = ids.shape[1]
    meta = build_metadata([Segment(ids[0].tolist(), 0, list(range(math.ceil(t / PAGE_SIZE))),
                                   slot=1, num_logits=t)])
    feed = {
        "input_ids": ids, "position_ids": meta.position_ids[None],
        "logits_idx": meta.logits_idx if logits_idx is None else logits_idx,
        "cu_seqlens": meta.cu_seqlens, "cu_seqlens_host": meta.cu_seqlens,
        "cache_lens": meta.cache_lens, "cache_lens_host": meta.cache_lens,
        "page_table": meta.page_table, "slot_idx": meta.slot_idx, "seg_kind_host": meta.seg_kind,
        "slot_mapping": kv_slot_mapping(meta, PAGE_SIZE),
    }
    with torch.inference_mode():
        out = gm(*[feed[p.name] for p in placeholders(gm)])
    return out if isinstance(out, (tuple, list)) else (out,)


@pytest.fixture(scope="module", params=FAMILIES)
def walked(request, tiny_dir):
    """Export, then apply every transform in pipeline order, recording outputs around each."""
    family = request.param
    model = load_model(tiny_dir(family), dtype="float32")
    torch.manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (1, T))
    with torch.inference_mode():
        plain = model(ids, torch.arange(T)[None])
    gm = export_model(model, max_tokens=512)
    name_inputs(gm)
    exported = run_graph(gm, ids)[0]
    ctx = DeployContext(model=model, page_size=PAGE_SIZE, max_batch_size=4, max_seq_len=64,
                        max_cache_gib=0.05)
    steps, resources = {}, []
    for t in transforms():
        before = run_graph(gm, ids)[0]
        asserts_before, ops_before = _num_asserts(gm), _num_specdeploy_ops(gm)
        info, done = run_transform(t, gm, ctx)
        resources += done.resources
        if t.stage == Stage.CACHE:
            _allocate(gm, ctx, resources)  # fresh (zeroed) caches for all declared so far
        steps[t.name] = dict(info=info, before=before, after=run_graph(gm, ids)[0],
                           asserts_before=asserts_before, asserts_after=_num_asserts(gm),
                           ops_before=ops_before, ops_after=_num_specdeploy_ops(gm))
    return dict(family=family, model=model, ids=ids, plain=plain, exported=exported, gm=gm,
                ctx=ctx, steps=steps, resources=resources)


def _allocate(gm, ctx, resources):
    plan = plan_cache(resources, ctx.page_size, ctx.max_batch_size, ctx.max_seq_len,
                      ctx.max_cache_gib, ctx.device)
    allocate(gm, resources, plan, ctx.device)
    return plan


def _num_asserts(gm) -> int:
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and "assert" in str(n.target))


def _num_specdeploy_ops(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace == "specdeploy")


def test_export_equals_plain_model(walked, close):
    close(walked["exported"], walked["plain"], rtol=EXACT)
    gm = walked["gm"]
    names = [p.name for p in placeholders(gm)]
    assert names[:2] == ["input_ids", "position_ids"]


def test_pipeline_order_is_staged():
    items = transforms()
    stages = [t.stage for t in items]
    assert stages == sorted(stages)
    names = [t.name for t in items]
    assert names[0] == "cleanup_export" and names[-1] == "compile_model"
    assert names.index("quantize_int8_weights") < names.index("insert_cached_attention")


def test_disabled_names_are_checked():
    from specdeploy.deploy.pipeline import run_pipeline

    with pytest.raises(ValueError, match="disabled: unknown transforms"):
        run_pipeline(None, DeployContext(model=None, disabled=frozenset({"insert_cache"})))


def test_cleanup_export(walked, close):
    step = walked["steps"]["cleanup_export"]
    # (the tiny llama's export has none since RoPE's cos / sin became one op)
    assert step["info"].num_matches == step["asserts_before"]
    assert step["asserts_before"] > 0 or walked["family"] == "llama"
    assert step["asserts_after"] == 0
    close(step["after"], step["before"], rtol=EXACT)


def test_gather_logits(walked, close):
    step = walked["steps"]["gather_logits"]
    assert step["info"].num_matches == 1
    close(step["after"], step["before"], rtol=EXACT)  # all rows requested


def test_call_kernels_directly(walked, close):
    step = walked["steps"]["call_kernels_directly"]
    assert step["info"].num_matches == step["ops_before"] > 0
    assert step["ops_after"] == 0
    close(step["after"], step["before"], rtol=EXACT)


def test_skipped_without_config(walked):
    for name in ("capture_hidden_states", "quantize_int8_weights", "compile_model"):
        info = walked["steps"][name]["info"]
        assert info.skipped and info.num_matches == 0, name


@pytest.mark.parametrize("name", ["insert_cached_attention", "insert_cached_ssm",
                                  "insert_cached_conv", "insert_cached_gdn"])
def test_insert_cache(walked, name, close):
    step = walked["steps"][name]
    want = expected_counts(walked["family"], walked["model"].hf_config)[name]
    assert step["info"].num_matches == want
    # one fresh prefill segment through the cached program = the uncached graph
    close(step["after"], step["before"], rtol=1e-4)
    close(step["after"], walked["plain"], rtol=1e-4)


def test_no_canonical_stateful_op_left(walked):
    ops = torch.ops.specdeploy
    left = [n.name for n in walked["gm"].graph.nodes if n.op == "call_function" and getattr(
        n.target, "overloadpacket", None) in (ops.attention, ops.ssm_scan, ops.causal_conv1d,
                                               ops.gated_delta_rule)]
    assert left == []
    kinds = {h.kind for h in walked["resources"]}
    assert kinds <= {"paged_kv", "state"}


def test_deployed_steps_match_plain_model(walked, close):
    """Chunked prefill, decode and a mixed ragged step through the final program, pages out of
    order, page size 5: logits at every requested row equal the plain model's."""
    gm, ctx, model = walked["gm"], walked["ctx"], walked["model"]
    plan = _allocate(gm, ctx, walked["resources"])
    dep = GraphDeployed(gm, ctx, [], plan, {}, model.cfg.vocab_size, walked["resources"])
    torch.manual_seed(1)
    lengths = (23, 9, 14)
    seqs = [torch.randint(3, model.cfg.vocab_size, (n,)).tolist() for n in lengths]
    with torch.inference_mode():
        full = [model(torch.tensor([s]), torch.arange(len(s))[None])[0] for s in seqs]
    pages = [[7, 2, 11, 0, 5], [3, 9], [10, 1, 4]]
    slots = [3, 0, 2]
    done = [0, 0, 0]
    schedule = [[(0, 8), (1, 1)], [(1, 6), (0, 1), (2, 12)], [(0, 1), (2, 1), (1, 1)],
                [(0, 12), (1, 1), (2, 1)], [(0, 1)]]
    for step in schedule:
        segs, want = [], []
        for i, n in step:
            a = done[i]
            segs.append(Segment(seqs[i][a:a + n], a, pages[i], slots[i], num_logits=min(n, 2)))
            want.append(full[i][a + n - min(n, 2):a + n])
            done[i] += n
        out = dep.forward(build_metadata(segs))
        close(out.logits, torch.cat(want), rtol=1e-4)
    assert done == list(lengths)

