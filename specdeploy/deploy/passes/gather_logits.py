"""Compute the LM head only for the tokens whose logits the step needs.

Prefill chunks need one row (or none); computing [T, vocab] logits would cost as much as a layer
per token. The pass finds the head's `linear` behind the graph output and indexes its input with a
new graph input `logits_idx` [N] first.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.graph import add_placeholder, finalize
from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register

_PASS_THROUGH = {
    torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default,
    torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
}


def find_head(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
        raise RuntimeError(f"gather_logits: expected the output to come from a linear, got {node}")
    return node


@register("gather_logits", Stage.PATTERN)
def gather_logits(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    head = find_head(gm)
    idx = add_placeholder(gm, "logits_idx")
    ctx.inputs["logits_idx"] = idx
    with gm.graph.inserting_before(head):
        picked = gm.graph.call_function(torch.ops.aten.index_select.default, (head.args[0], 1, idx))
    head.replace_input_with(head.args[0], picked)
    finalize(gm)
    return TransformInfo("gather_logits", Stage.PATTERN, 1)
