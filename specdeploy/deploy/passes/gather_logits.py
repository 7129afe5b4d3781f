"""Compute the LM head only for the tokens whose logits the step needs.

Prefill chunks need one row (or none); computing [T, vocab] logits would cost as much as a layer
per token. The pass finds the head's `linear` behind the graph output and indexes its input with a
new graph input `logits_idx` [N] first.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import add_placeholder, find_head
from specdeploy.deploy.pipeline import Done, Stage, register


@register("gather_logits", Stage.PATTERN, requires_match=True)
def gather_logits(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    head = find_head(gm)
    idx = add_placeholder(gm, "logits_idx")
    with gm.graph.inserting_before(head):
        picked = gm.graph.call_function(torch.ops.aten.index_select.default, (head.args[0], 1, idx))
    head.replace_input_with(head.args[0], picked)
    return Done(1)
