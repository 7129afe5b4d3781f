"""Compute the LM head only for the tokens whose logits the step needs.

Prefill chunks need one row (or none); computing [T, vocab] logits would cost as much as a layer
per token. The pass finds the head's `linear` behind the graph output and indexes its input with a
new graph input `logits_idx` [N] first.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.graph import add_placeholder, finalize, find_head
from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register


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
