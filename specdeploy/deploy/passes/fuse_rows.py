"""Fuse the small op chains around the linears of a step into one row op each.

- `add(a, b)` whose sum feeds an `rms_norm` (the residual add before the next norm) becomes
  one `add_rms_norm` giving both the sum and the normed rows.
- `mul(silu(x[..., :n]), x[..., n:2n])` on a fused gate/up projection becomes `silu_mul(x, n)`.

At decode sizes each torch op is mostly dispatch, so a 30-layer step saves ~120 op calls. Both
fused kernels are row-wise (batch-invariant), so greedy speculation stays lossless.
Runs after the linear fusions, which create the fused gate/up projections it matches.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import is_op
from specdeploy.deploy.pipeline import Done, Stage, register

_ADD = torch.ops.aten.add.Tensor
_MUL = torch.ops.aten.mul.Tensor
_SILU = torch.ops.aten.silu.default
_SLICE = torch.ops.aten.slice.Tensor
_NORM = torch.ops.specdeploy.rms_norm


def _fuse_add_norm(gm: fx.GraphModule) -> int:
    n = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, _NORM) or node.args[0].op != "call_function":
            continue
        add = node.args[0]
        if (add.target is not _ADD or len(add.args) != 2 or add.kwargs
                or not all(isinstance(a, fx.Node) for a in add.args)):
            continue
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_function(torch.ops.specdeploy.add_rms_norm.default,
                                           (*add.args, *node.args[1:]))
            total = gm.graph.call_function(operator.getitem, (fused, 0))
            normed = gm.graph.call_function(operator.getitem, (fused, 1))
        for src, dst in ((add, total), (node, normed)):
            if "val" in src.meta:
                dst.meta["val"] = src.meta["val"]
        node.replace_all_uses_with(normed)
        gm.graph.erase_node(node)
        add.replace_all_uses_with(total)
        gm.graph.erase_node(add)
        n += 1
    return n


def _halves(gate: fx.Node, up: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, n) when gate = x[..., 0:n] and up = x[..., n:2n] (slices of the last dim, as the
    linear fusions write them; x may be wider)."""
    if gate.target is not _SLICE or up.target is not _SLICE or gate.args[0] is not up.args[0]:
        return None
    (_, dg, g0, g1), (_, du, u0, u1) = (tuple(s.args) + (None,) * (4 - len(s.args))
                                        for s in (gate, up))
    val = gate.args[0].meta.get("val") if isinstance(gate.args[0], fx.Node) else None
    last = {-1} | ({val.dim() - 1} if val is not None else set())  # (export may write dim 2)
    if dg not in last or du not in last or g0 != 0 or not isinstance(g1, int) \
            or (u0, u1) != (g1, 2 * g1):
        return None
    return gate.args[0], g1


def _fuse_silu_mul(gm: fx.GraphModule) -> int:
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _MUL or len(node.args) != 2:
            continue
        silu, up = node.args
        if not (isinstance(silu, fx.Node) and isinstance(up, fx.Node)
                and silu.target is _SILU and len(silu.users) == 1):
            continue
        found = _halves(silu.args[0], up)
        if found is None:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.specdeploy.silu_mul.default, found)
        if "val" in node.meta:
            fused.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        gm.graph.erase_node(silu)
        n += 1
    return n


@register("fuse_row_ops", Stage.OPTIMIZE)
def fuse_row_ops(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    adds, gates = _fuse_add_norm(gm), _fuse_silu_mul(gm)
    return Done(adds + gates, f"{adds} add+rms_norm, {gates} silu*mul")
