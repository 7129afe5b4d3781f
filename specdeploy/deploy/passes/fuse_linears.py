"""Fuse linears that read the same input (q/k/v, gate/up) into one matmul.

At small batch a step is a chain of GEMVs; one wider GEMV streams the same weights with fewer
calls. The fused weight is one new tensor and the original parameters become views into it, so
memory does not grow. Only plain fp linears qualify (quantized ones are `int8_linear` by now).
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor, split_fused_output
from specdeploy.deploy.pipeline import Done, Stage, register

_LINEAR = torch.ops.aten.linear.default


def _weight(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    if len(node.args) > 2 and node.args[2] is not None:  # biased linears are left alone
        return None
    return attr_tensor(gm, node.args[1])


def _groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    groups = []
    for node in gm.graph.nodes:
        users = [u for u in node.users if u.op == "call_function" and u.target is _LINEAR
                 and u.args[0] is node and _weight(gm, u) is not None]
        if len(users) < 2:
            continue
        ws = [_weight(gm, u) for u in users]
        if len({(w.dtype, w.shape[1], w.device) for w in ws}) == 1 and \
                len({id(w) for w in ws}) == len(ws):
            groups.append(users)
    return groups


@register("fuse_parallel_linears", Stage.OPTIMIZE)
def fuse_parallel_linears(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    groups = _groups(gm)
    for i, users in enumerate(groups):
        weights = [_weight(gm, u) for u in users]
        fused = torch.cat([w.detach() for w in weights], 0)
        name = f"fused_linear_{i}"
        gm.register_buffer(name, fused, persistent=False)
        start = 0
        for w in weights:  # NOTE: the originals now alias the fused storage
            w.data = fused[start:start + w.shape[0]]
            start += w.shape[0]
        first = min(users, key=lambda n: list(gm.graph.nodes).index(n))
        with gm.graph.inserting_before(first):
            attr = gm.graph.get_attr(name)
            out = gm.graph.call_function(_LINEAR, (users[0].args[0], attr))
        split_fused_output(gm, out, users, [w.shape[0] for w in weights])
    return Done(len(groups), f"{sum(len(g) for g in groups)} linears into {len(groups)}")
