"""The `shard` transform alone: each rank's graph, run as threads of one process whose
collectives sum (or concatenate) in rank order, reproduces the unsharded graph (fp32, 1e-5 of the
output scale) for the families here, with TP, EP, KV replication and `shard_layers`."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.passes.shard import param_bytes
from specdeploy.deploy.pipeline import run_transform
from specdeploy.distributed import DistConfig
from specdeploy.loading import load_model
from specdeploy.ops.collectives import ThreadGroup, thread_rank
from specdeploy.ops.shard import seg_units

_EXPORTED: dict[int, fx.GraphModule] = {}


def _graph(model, dist):
    """The exported graph (once per model) copied for one rank, then the shard transform."""
    if id(model) not in _EXPORTED:
        gm = export_model(model, max_tokens=64, keep_hints=True)
        run_transform("cleanup_export", gm, DeployContext(model))
        _EXPORTED[id(model)] = gm
    # NOTE: a new GraphModule gets its own module tree (sharing the tensors, which the
    # transform replaces rather than mutates) and a copied graph
    gm = fx.GraphModule(_EXPORTED[id(model)], copy.deepcopy(_EXPORTED[id(model)].graph))
    info, _ = run_transform("shard", gm, DeployContext(model, dist=dist))
    return gm, info


def run_ranks(model, dist: DistConfig, ids, pos):
    """Per-rank sharded graphs run in lockstep threads; returns (outputs, graphs, infos)."""
    built = [_graph(model, dist.for_rank(r)) for r in range(dist.tp_size)]
    group, outs, errors = ThreadGroup(dist.tp_size, timeout=60), [None] * dist.tp_size, []

    def work(r):
        try:
            with thread_rank(group, r), torch.no_grad():
                outs[r] = built[r][0](ids, pos)[0]
        except BaseException as e:  # surfaced below; a barrier timeout would hide it
            errors.append(e)
            group._barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(dist.tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return outs, [g for g, _ in built], [i for _, i in built]


_MODELS: dict = {}


def _model(tiny_dir, family):
    if family not in _MODELS:
        _MODELS[family] = load_model(tiny_dir(family), dtype="float32")
    return _MODELS[family]


CASES = [
    ("llama", DistConfig(2)),
    ("nemotron_h", DistConfig(2)),
    ("nemotron_h", DistConfig(2, ep_size=2)),
    ("qwen3_5_moe", DistConfig(2)),
    ("qwen3_5_moe", DistConfig(2, ep_size=2)),
    ("qwen3_5_moe", DistConfig(2, shard_layers=("moe", "delta", "mha"))),
    ("deepseek_v3", DistConfig(2)),  # MLA: q_b / kv_b / o heads split, the latent replicated
    ("deepseek_v3", DistConfig(2, ep_size=2)),
]


def _case_id(c) -> str:
    if isinstance(c, str):
        return c
    some = "-" + "+".join(c.shard_layers) if len(c.shard_layers) < 6 else ""
    return f"tp{c.tp_size}ep{c.ep_size}{some}"


@pytest.mark.parametrize("family,dist", CASES, ids=_case_id)
def test_ranks_sum_to_unsharded(tiny_dir, close, family, dist):
    model = _model(tiny_dir, family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (1, 21), generator=g)
    pos = torch.arange(21)[None]
    full, _ = _graph(model, DistConfig())
    with torch.no_grad():
        want = full(ids, pos)[0]
    outs, graphs, infos = run_ranks(model, dist, ids, pos)
    for out in outs:
        close(out, want, rtol=1e-5)
    assert all(not i.skipped and i.num_matches > 0 for i in infos)
    # every hint is gone; collectives are there
    for gm in graphs:
        targets = {str(n.target) for n in gm.graph.nodes}
        assert not any("tp_param" in t or "tp_split" in t or "tp_reduce" in t for t in targets)
        assert "specdeploy.all_reduce.default" in targets


def test_rank_bytes_halve(tiny_dir):
    """Sharded parts split in two: each rank's weights ≈ (total - replicated) / 2 + replicated,
    within 1% (replicated: embeddings, norms, routers, MTP-free here)."""
    model = _model(tiny_dir, "qwen3_5_moe")
    full, _ = _graph(model, DistConfig())
    total = param_bytes(full)
    ranks = [_graph(model, DistConfig(2, rank=r))[0] for r in range(2)]
    names = {n for n, _ in full.named_parameters()}
    # parameters every rank keeps whole: 1-D norms over hidden / head dims, routers, embedding
    replicated = sum(p.numel() * p.element_size() for n, p in full.named_parameters()
                     if n.endswith(("layernorm.weight", "norm.weight", "q_norm.weight",
                                    "k_norm.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                                    "embed_tokens.weight")))
    assert names
    for gm in ranks:
        got = param_bytes(gm)
        want = (total - replicated) / 2 + replicated
        assert abs(got - want) <= 0.01 * want, (got, want, total)


def test_kv_replication_three_kv_heads(tmp_path, close):
    """6 query heads over 3 KV heads on 2 ranks: each rank keeps the KV heads its 3 query heads
    read (one per query head), and the result is unchanged."""
    from specdeploy.models import llama

    path = llama.make_tiny(tmp_path / "kv3", config_overrides=dict(
        num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48))
    assert seg_units(3, 6, 2, 0, "kv") == [0, 0, 1] and seg_units(3, 6, 2, 1, "kv") == [1, 2, 2]
    assert seg_units(2, 8, 4, 3, "kv") == [1]  # fewer KV heads than ranks: replicated
    model = load_model(path, dtype="float32")
    ids, pos = torch.randint(3, 120, (1, 9)), torch.arange(9)[None]
    full, _ = _graph(model, DistConfig())
    with torch.no_grad():
        want = full(ids, pos)[0]
    for out in run_ranks(model, DistConfig(2), ids, pos)[0]:
        close(out, want, rtol=1e-5)


def test_bad_divisibility_names_the_layer(tiny_dir):
    model = load_model(tiny_dir("llama"), dtype="float32")  # 4 query heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        _graph(model, DistConfig(3))


def test_cache_sized_per_rank_and_reported(tiny_dir):
    """One rank built alone (no process group: inspection, `deploy --list-transforms`): its KV
    pages hold its KV heads only, half of the unsharded ones, and the report says so."""
    from specdeploy.cache.handlers import PagedKV
    from specdeploy.deploy.build import build

    opts = dict(max_batch_size=2, max_seq_len=64, max_cache_gib=0.01, page_size=8)
    one, two = build(tiny_dir("llama"), **opts), build(tiny_dir("llama"), dist=DistConfig(2),
                                                         **opts)
    kv = [[h.bytes_per_page(8) for h in d.resources if isinstance(h, PagedKV)] for d in (one, two)]
    assert kv[0] and kv[1] == [b // 2 for b in kv[0]]
    report = two.report()
    assert "rank 0 of 2" in report and "tp=2 ep=1 rank 0" in report


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe"])
def test_per_rank_loading_reads_the_same_slices(tiny_dir, family):
    """Placeholders (checkpoint/lazy.py) sharded for each rank give exactly the weights of the
    fully loaded model sharded (oracle), while holding only the rank's share at once."""
    from specdeploy.checkpoint.lazy import LazyWeights

    model = _model(tiny_dir, family)
    for r in range(2):
        lazy = LazyWeights()
        lazy_model = load_model(tiny_dir(family), dtype="float32", lazy=lazy)
        assert all(lazy.is_lazy(p) for p in lazy_model.parameters())
        gm = export_model(lazy_model, max_tokens=64, keep_hints=True)
        run_transform("cleanup_export", gm, DeployContext(lazy_model))
        run_transform("shard", gm, DeployContext(lazy_model, dist=DistConfig(2, rank=r),
                                                 lazy=lazy))
        want = dict(_graph(model, DistConfig(2, rank=r))[0].named_parameters())
        got = dict(gm.named_parameters())
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        for name, b in _graph(model, DistConfig(2, rank=r))[0].named_buffers():
            assert torch.equal(dict(gm.named_buffers())[name], b), name
        kept = param_bytes(gm)  # weights and buffers (e_score_correction_bias, inv_freq)
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        params = sum(p.numel() * p.element_size() for p in gm.parameters())
        assert params <= lazy.resident <= kept
        assert lazy.resident <= lazy.peak <= lazy.resident + largest


def test_weight_read_before_loading_is_refused(tiny_dir):
    """A weight computed from a placeholder (NaN) or a placeholder never read is an error."""
    from specdeploy.checkpoint.lazy import LazyWeights, check_loaded

    lazy = LazyWeights()
    m = load_model(tiny_dir("llama"), dtype="float32", lazy=lazy)
    w = m.lm_head.weight
    with pytest.raises(RuntimeError, match="computed from a weight before it was loaded"):
        check_loaded([("draft_head", w[:3].clone())], lazy)
    with pytest.raises(RuntimeError, match="never loaded"):
        check_loaded([("lm_head.weight", w)], lazy)
    full = lazy.materialize(w)
    assert torch.equal(full, load_model(tiny_dir("llama"), dtype="float32").lm_head.weight)
    check_loaded([("lm_head.weight", full)], lazy)
