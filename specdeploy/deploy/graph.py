"""Small FX helpers shared by the transforms."""
from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def is_op(node: fx.Node, op) -> bool:
    """True when `node` calls `op` (an OpOverloadPacket like torch.ops.specdeploy.attention or an
    overload)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is op:
        return True
    return getattr(target, "overloadpacket", None) is op


def nodes_calling(gm: fx.GraphModule, op) -> Iterator[fx.Node]:
    return (n for n in list(gm.graph.nodes) if is_op(n, op))


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def add_placeholder(gm: fx.GraphModule, name: str, example: torch.Tensor | None = None) -> fx.Node:
    """Append a graph input `name` (idempotent: an existing input of that name is returned)."""
    existing = {n.name: n for n in placeholders(gm)}
    if name in existing:
        return existing[name]
    last = placeholders(gm)[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    if example is not None:
        node.meta["val"] = example
    return node


def add_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
    """Register `tensor` as a buffer of gm and return a get_attr node for it."""
    gm.register_buffer(name, tensor, persistent=False)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def getitem_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    """For a tuple-returning node: index → the getitem nodes reading it."""
    out: dict[int, list[fx.Node]] = {}
    for u in node.users:
        if u.op == "call_function" and u.target is __import__("operator").getitem:
            out.setdefault(u.args[1], []).append(u)
        else:
            raise RuntimeError(f"{node.name}: non-getitem user {u.name} of a tuple output")
    return out


def attr_tensor(gm: fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a `get_attr` node reads (a weight, a buffer); None for anything else."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    return operator.attrgetter(node.target)(gm)


def split_fused_output(gm: fx.GraphModule, out: fx.Node, nodes: list[fx.Node],
                       widths: list[int]) -> None:
    """`out` computes `nodes`' outputs side by side on the last dim (a fused linear): each node's
    users get a slice of it instead, and the nodes are erased."""
    start, last = 0, out
    for node, width in zip(nodes, widths):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(
                torch.ops.aten.slice.Tensor, (out, -1, start, start + width))
        if "val" in node.meta:
            last.meta["val"] = node.meta["val"]
        last.meta["slice_in_range"] = True  # within `out`'s last dim by construction
        node.replace_all_uses_with(last)
        gm.graph.erase_node(node)
        start += width


def finalize(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def op_args(node: fx.Node) -> dict:
    """Name → value for every schema argument of a call to a torch op (defaults filled in)."""
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise RuntimeError(f"{node.name}: missing argument {arg.name}")
    return out


def meta_shape(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    if val is None:
        raise RuntimeError(f"{node.name}: no shape metadata (was the graph exported?)")
    return tuple(val.shape)


_PASS_THROUGH = {
    torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default,
    torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
}


# elementwise ops on the logits with scalar operands only (Gemma's final logit softcapping,
# tanh(logits / c) * c): each row of the output is its head row's function, so the head may be
# gathered or sharded before them
_SCALAR_ELEMENTWISE = {
    torch.ops.aten.tanh.default, torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Scalar, torch.ops.aten.mul.Scalar,
}


def _passes_through(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _PASS_THROUGH:
        return True
    return node.target in _SCALAR_ELEMENTWISE and isinstance(node.args[0], fx.Node) and not any(
        isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))


def find_head(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    while _passes_through(node):
        node = node.args[0]
    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
        raise RuntimeError(f"gather_logits: expected the output to come from a linear, got {node}")
    return node


def param_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the weights the graph reads (cache buffers are not allocated yet)."""
    seen = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def drop_unused_attrs(gm: fx.GraphModule) -> None:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n, _ in (*gm.named_parameters(remove_duplicate=False),
                                *gm.named_buffers(remove_duplicate=False))]:
        if name not in used:
            mod_name, _, leaf = name.rpartition(".")
            mod = gm.get_submodule(mod_name) if mod_name else gm
            mod._parameters.pop(leaf, None)
            mod._buffers.pop(leaf, None)


def repropagate(gm: fx.GraphModule) -> None:
    """Recompute every node's fake value (shapes changed with the slices)."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    mode = placeholders(gm)[0].meta["val"].fake_mode
    # inputs added by earlier transforms (logits_idx: an index vector) carry no fake value
    bare = [p for p in placeholders(gm) if "val" not in p.meta]
    with mode:
        vals = [p.meta.get("val") if "val" in p.meta else torch.zeros(2, dtype=torch.long)
                for p in placeholders(gm)]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
    for p in bare:
        p.meta.pop("val", None)


def weight_bytes(gms: list[fx.GraphModule]) -> int:
    """Bytes of the weights the graphs hold together (a shared tensor once), without the cache
    buffers allocated on the root after the pipeline (registered non-persistent)."""
    seen = {}
    for gm in gms:
        for name, t in (*gm.named_parameters(), *gm.named_buffers()):
            if name not in gm._non_persistent_buffers_set:
                seen[t.data_ptr()] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


def drop_unread_params(gm: fx.GraphModule, targets: set) -> int:
    """Erase the unread get_attr nodes among `targets` and every parameter name over their
    storage (a tied head has two) that nothing reads any more (a transform read the weight
    another way): the graph then holds no reference to them. Bytes freed."""
    gone = {_attr(gm, t).untyped_storage().data_ptr() for t in targets}
    live, freed = set(), {}
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            if not node.users and node.target in targets:
                gm.graph.erase_node(node)
            else:
                live.add(_attr(gm, node.target).untyped_storage().data_ptr())
    for name, t in list(gm.named_parameters(remove_duplicate=False)):
        ptr = t.untyped_storage().data_ptr()
        if ptr in gone and ptr not in live:
            owner, _, leaf = name.rpartition(".")
            (gm.get_submodule(owner) if owner else gm)._parameters.pop(leaf, None)
            freed[ptr] = t.untyped_storage().nbytes()
    return sum(freed.values())


def _attr(gm: fx.GraphModule, target: str):
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf)
