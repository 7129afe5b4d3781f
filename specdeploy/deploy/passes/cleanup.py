"""Post-export clean-up: drop runtime assertions and shape guards torch.export leaves behind."""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.pipeline import Done, Stage, register

_ASSERTS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_tensor_metadata.default,
}


@register("cleanup_export", Stage.POST_EXPORT)
def cleanup_export(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (
            node.target in _ASSERTS or "assert" in getattr(node.target, "__name__", "")
        ):
            gm.graph.erase_node(node)
            n += 1
    return Done(n)
