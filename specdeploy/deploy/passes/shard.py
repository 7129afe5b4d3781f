"""The `shard` transform: apply the model's sharding hints (ops/shard.py) for one rank.

For `ctx.dist = DistConfig(tp_size, ep_size, rank)` every `tp_param` hint slices its parameter
(the rank keeps only its slice; the full tensor is dropped from the graph), every `tp_split`
takes the rank's sizes, every `tp_reduce` becomes an `all_reduce` collective, routed experts are
split over EP groups (token → expert ids remapped, other experts' weights zeroed) and the LM head
found behind the output becomes vocabulary-parallel (rows split, an `all_gather` of the logits).
Layer types not in `shard_layers` keep their hints dropped: replicated on every rank. Graphs
exported for one process carry no hints (export drops them); the transform then skips. Shapes
are re-propagated afterwards, so cache resources (CACHE stage) are sized per rank.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.checkpoint.lazy import LazyWeights, check_loaded
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import drop_unused_attrs, find_head, is_op, param_bytes, repropagate
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.deploy.shard_slice import (
    hint_name,
    prequant_key,
    read_slice,
    slice_blocks,
    slice_param,
)
from specdeploy.distributed.config import DistConfig
from specdeploy.ops.shard import piece_sizes, seg_index, segs_of

_ops = torch.ops.specdeploy
HINTS = (_ops.tp_param, _ops.tp_split, _ops.tp_reduce)


def _get_attr(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise RuntimeError(f"shard: a tp_param hint reads {node}, not a parameter")
    return operator.attrgetter(node.target)(gm)


def _materialize(gm: fx.GraphModule, lazy: LazyWeights | None, ggml: dict | None = None,
                 cut: list | None = None) -> None:
    """Per-rank loading: what the rank keeps whole (replicated) is read now, after the slices
    (so a rank never holds more than its share and one whole tensor); a GGUF weight's blocks
    follow it to the loaded tensor."""
    if lazy is None:
        return
    named = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]
    for name, t in named:
        if lazy.is_lazy(t):
            value = lazy.materialize(t)
            blocks = None if ggml is None else ggml.get(prequant_key(t))
            if blocks is not None:
                cut.append((value, blocks))
            _set_attr(gm, name, value)
    check_loaded([*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()], lazy)


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = target.rpartition(".")
    mod = gm.get_submodule(mod_name) if mod_name else gm
    if leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        setattr(mod, leaf, torch.nn.Parameter(value, requires_grad=False))


def _replace_param(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor, n: int) -> None:
    """Point the hint's users at a get_attr of `value`: in place of the full tensor when this
    hint is its only reader (so the full one is freed), else under a new name."""
    src = node.args[0]
    readers = [u for g in gm.graph.nodes if g.op == "get_attr" and g.target == src.target
               for u in g.users]
    target = src.target if readers == [node] else f"{src.target}_tp{n}"
    _set_attr(gm, target, value)
    with gm.graph.inserting_before(node):
        new = _like(gm.graph.get_attr(target), node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _drop(gm: fx.GraphModule, node: fx.Node) -> None:
    """A hint left as the plain op it stands for (replicated layer types, world size 1)."""
    if is_op(node, _ops.tp_split):
        _, _, dim, counts, sizes, _, _ = node.args
        _split(gm, node, piece_sizes(counts, sizes), dim)
        return
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)


def _like(new: fx.Node, old: fx.Node) -> fx.Node:
    """`new` stands where `old` was: same module path (capture_hidden reads layers by it)."""
    for key in ("nn_module_stack", "stack_trace", "val"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    return new


def _split(gm: fx.GraphModule, node: fx.Node, sizes: list[int], dim: int) -> None:
    with gm.graph.inserting_before(node):
        new = _like(gm.graph.call_function(torch.ops.aten.split_with_sizes.default,
                                           (node.args[0], sizes, dim)), node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _expert_remap(gm: fx.GraphModule, moe: fx.Node, e_local: int, d: DistConfig) -> None:
    """EP: this rank holds experts [lo, lo + e_local); tokens routed elsewhere get weight 0 here
    (their expert's rank adds them in the all-reduce)."""
    lo = (d.rank // d.moe_tp) * e_local
    ids, weights = moe.args[1], moe.args[2]
    g = gm.graph
    with g.inserting_before(moe):
        local = g.call_function(torch.clamp, (g.call_function(torch.sub, (ids, lo)), 0,
                                              e_local - 1))
        mine = g.call_function(torch.logical_and, (g.call_function(torch.ge, (ids, lo)),
                                                   g.call_function(torch.lt,
                                                                   (ids, lo + e_local))))
        kept = g.call_function(torch.mul, (weights, g.call_function(
            torch.Tensor.to, (mine, weights.meta["val"].dtype))))
    moe.update_arg(1, local)
    moe.update_arg(2, kept)


def _ggml_map(ctx: DeployContext) -> dict | None:
    """A GGUF model's weights with blocks, by tensor identity (their cuts keep blocks)."""
    if ctx.model is None or not getattr(ctx.model, "ggml_weights", None):
        return None
    from specdeploy.deploy.passes.ggml_weights import _weight_map

    return _weight_map(ctx) or None


def _lm_head(gm: fx.GraphModule, d: DistConfig, lazy: LazyWeights | None,
             ggml: dict | None = None, cut: list | None = None) -> str:
    head = find_head(gm)
    w = _get_attr(gm, head.args[1])
    if len(head.args) > 2 and head.args[2] is not None:
        return "lm_head replicated (bias)"
    if w.shape[0] % d.tp_size:
        return f"lm_head replicated (vocab {w.shape[0]} % {d.tp_size})"
    k = w.shape[0] // d.tp_size
    value = read_slice(w, lambda full: full.detach()[d.rank * k:(d.rank + 1) * k].contiguous(),
                       lazy)
    blocks = None if ggml is None else ggml.get(prequant_key(w))
    if blocks is not None:  # the head's rows of blocks
        cut.append((value, slice_blocks(blocks, 2, None, 0,
                                        torch.arange(d.rank * k, (d.rank + 1) * k))))
    src = head.args[1]
    target = src.target if len(src.users) == 1 and sum(
        1 for g in gm.graph.nodes if g.op == "get_attr" and g.target == src.target) == 1 \
        else f"{src.target}_vocab"
    if target.endswith("_vocab") and not hasattr(gm, "lm_head"):
        # a tied head's slice: named as a head, so name-based rules (quantize's lm_head
        # exclusion) still see it as one
        gm.add_submodule("lm_head", torch.nn.Module())
        target = "lm_head.weight"
    _set_attr(gm, target, value)
    with gm.graph.inserting_before(head):
        head.update_arg(1, gm.graph.get_attr(target))
    with gm.graph.inserting_after(head):
        gathered = _like(gm.graph.call_function(_ops.all_gather.default, (head, -1, d.tp_size)),
                         head)
    head.replace_all_uses_with(gathered, delete_user_cb=lambda u: u is not gathered)
    return f"lm_head vocab-parallel ({k} rows)"


def _prequant_map(ctx: DeployContext) -> dict | None:
    # NOTE: any module's `prequant_weights`, not only the root's: a drafter program's are on its
    # `eagle_drafter` (a quantized MTP layer); without them its slices would run dequantized
    if ctx.model is None:
        return None
    from specdeploy.deploy.passes.prequantized import weight_map

    return weight_map(ctx.model)[0] or None


def _hints(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if any(is_op(n, h) for h in HINTS)]


def drop_hints(gm: fx.GraphModule) -> int:
    """Every hint replaced by the plain op it stands for (one process: nothing is sharded)."""
    hints = _hints(gm)
    for n in hints:
        _drop(gm, n)
    if hints:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return len(hints)


@register("shard", Stage.SHARD)
def shard(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    d = ctx.dist or DistConfig()
    hints = _hints(gm)
    if d.world_size == 1:
        n = drop_hints(gm)  # exported with keep_hints but deployed alone
        return Done(n, "world size 1: hints dropped") if n else Skipped("world size 1")
    before = param_bytes(gm)
    on = set(d.shard_layers)
    prequant = _prequant_map(ctx)
    ggml = _ggml_map(ctx)
    cut: list = []  # (a GGUF weight's slice, its blocks' cut)
    for moe in [n for n in gm.graph.nodes if is_op(n, _ops.moe_experts)]:  # EP: before hints go
        up = moe.args[3]
        if d.ep_size > 1 and is_op(up, _ops.tp_param) and up.args[1] in on and \
                up.args[2] == "expert_colwise":
            _expert_remap(gm, moe, _get_attr(gm, up.args[0]).shape[0] // d.ep_size, d)
    counts: dict[str, int] = {}
    for i, n in enumerate(hints):
        if n.args[1] not in on:
            _drop(gm, n)
            continue
        counts[n.args[1]] = counts.get(n.args[1], 0) + 1
        if is_op(n, _ops.tp_param):
            _replace_param(gm, n, slice_param(_get_attr(gm, n.args[0]), n, d, ctx.lazy,
                                              prequant, ctx.prequant_slices, ggml, cut), i)
        elif is_op(n, _ops.tp_split):
            _, lt, dim, pcounts, sizes, units, leads = n.args
            if lt == "moe":
                raise ValueError("shard: tp_split hints on moe layers are not supported")
            parts = seg_index(segs_of(sizes, units, leads), d.tp_size, d.rank, hint_name(n))
            _split(gm, n, piece_sizes(pcounts, [len(p) for p in parts]), dim)
        else:
            with gm.graph.inserting_before(n):
                red = _like(gm.graph.call_function(_ops.all_reduce.default, (n.args[0],)), n)
            n.replace_all_uses_with(red)
            gm.graph.erase_node(n)
    head = _lm_head(gm, d, ctx.lazy, ggml, cut) if "lm_head" in on else "lm_head replicated"
    drop_unused_attrs(gm)
    _materialize(gm, ctx.lazy, ggml, cut)
    if cut:  # ggml_linears / ggml_moe_experts find the slices' blocks by their identity
        ctx.model.ggml_tensors = [*getattr(ctx.model, "ggml_tensors", ()), *cut]
    repropagate(gm)
    after = param_bytes(gm)
    per_type = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return Done(len(hints), f"tp={d.tp_size} ep={d.ep_size} rank {d.rank}: {per_type}; {head}; "
                f"weights {after / 2**20:.2f} of {before / 2**20:.2f} MiB",
                bytes_saved=before - after)
