"""`fold_constants`: compute once, at deploy time, what a step would recompute from weights alone.

Export leaves ops on parameters in the graph: Mamba2 / gated-delta layers' `-exp(A_log)`
(exp, neg), their conv weight's `squeeze` / `select`; each costs a dispatch (a few microseconds)
every step at batch size 1 and always gives the same tensor. Here an aten op whose every tensor
input is a weight, a buffer or an already folded value is evaluated once; where its readers
are not all folded, its value becomes a buffer of the graph module (`_folded_<n>`) read by one
`get_attr`.

What is never folded: an op that mutates, a value (a weight or a result) that an op may write
(an argument its schema marks written: the cached ops' cache tensors; any argument of a call
that is not an op overload), an op with
no tensor input (factories: `zeros`, `arange`; nothing is gained), and a result that would
hold new memory of more than `MAX_NUMEL` elements (a cast or transpose-copy of a whole weight
would double it; views of a weight are free and always folded). Runs before the direct-kernel
rewrite (the targets are still op overloads, whose schemas say what mutates).
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.pipeline import Done, Stage, register

MAX_NUMEL = 1 << 16


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` may write `node`'s value: an argument its schema marks written (or any
    argument of a call whose schema is unknown)."""
    if user.op != "call_function":
        return user.op != "output"
    t = user.target
    if not isinstance(t, torch._ops.OpOverload):
        return True
    for i, arg in enumerate(t._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
        if node in pytree.tree_leaves(value):
            return True
    return False


def _written(node: fx.Node) -> bool:
    return any(_writes(u, node) for u in node.users)


def _pure_aten(node: fx.Node) -> bool:
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and t.namespace == "aten" and not t._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in t.tags)


def _resolve(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _storages(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _values(gm: fx.GraphModule, sources: dict[fx.Node, fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """Every node whose value is known at deploy time (weights and what follows from them);
    `sources` gets the nodes whose value is a weight itself: node -> that weight's get_attr."""
    values: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _resolve(gm, node.target)
            if isinstance(value, torch.Tensor) and not _written(node):
                values[node] = value
            continue
        if not _pure_aten(node) or _written(node):
            continue
        inputs = [a for a in pytree.arg_tree_leaves(*node.args, **node.kwargs)
                  if isinstance(a, fx.Node)]
        if not inputs or any(a not in values for a in inputs):
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, values.__getitem__, (node.args, node.kwargs))
        with torch.no_grad():
            out = node.target(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            continue
        same = next((a for a in inputs if values[a] is out), None)
        root = sources.get(same, same)
        if root is not None and root.op == "get_attr":  # the op returned a weight itself
            values[node] = out  # (a cast to its own dtype)
            sources[node] = root
            continue
        shared = {_storages(values[a]) for a in inputs if isinstance(values[a], torch.Tensor)}
        if out.numel() > MAX_NUMEL and _storages(out) not in shared:
            continue
        values[node] = out
    return values


@register("fold_constants", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True: inductor folds them itself" if ctx.compile else None)
def fold_constants(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    sources: dict[fx.Node, fx.Node] = {}
    values = _values(gm, sources)
    folded = [n for n in values if n.op == "call_function"]
    if not folded:
        return Done(0)
    kept = 0
    for node in folded:
        if all(u in values for u in node.users):
            continue  # read only by other folded nodes: they take its value
        if node in sources:  # the weight itself: read where it is (its name kept)
            node.replace_all_uses_with(sources[node])
            continue
        name = f"_folded_{kept}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, values[node], persistent=False)
        gm.__dict__[name] = values[node]  # NOTE: read as a plain attribute (flatten_attrs)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        kept += 1
    for node in reversed(folded):
        if not node.users:
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return Done(len(folded), f"{len(folded)} ops on weights computed once, "
                             f"{kept} values kept as buffers")
