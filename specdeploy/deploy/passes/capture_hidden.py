"""Capture target hidden states for drafters as an extra graph output.

EAGLE-3 reads the residual stream after a few target layers (low / middle / high); MTP reads the
final-normed hidden state (the LM head's input). The pass finds those tensors by module path
(`*.layers.N` from export's `nn_module_stack`) and appends one [1, T, Hc] output (layers
concatenated in the order given). Runs before `gather_logits`, so every token is captured.
"""
from __future__ import annotations

import re

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import find_head
from specdeploy.deploy.pipeline import Done, Stage, register

FINAL = -1  # capture index meaning "the final-normed hidden state" (MTP)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _layer_of(path: str) -> int | None:
    m = re.match(r"^(?:[\w.]*\.)?layers\.(\d+)(?:\.|$)", path)
    if m is None or path.startswith(("mtp", "eagle_drafter")):
        return None
    return int(m.group(1))


def layer_outputs(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Decoder layer index → the node that leaves that layer (its residual-stream output)."""
    members: dict[int, set[fx.Node]] = {}
    for n in gm.graph.nodes:
        i = _layer_of(_module_path(n))
        if i is not None:
            members.setdefault(i, set()).add(n)
    out = {}
    for i, nodes in members.items():
        leaving = [n for n in nodes if any(u not in nodes for u in n.users)]
        if len(leaving) != 1:
            raise RuntimeError(f"capture: layer {i} has {len(leaving)} outputs, expected 1")
        out[i] = leaving[0]
    return out


@register("capture_hidden_states", Stage.PATTERN, requires_match=True,
          skip_if=lambda ctx: None if ctx.capture_layers else "no drafter")
def capture_hidden_states(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    outputs = layer_outputs(gm)
    picked = []
    for i in ctx.capture_layers:
        if i == FINAL:
            picked.append(find_head(gm).args[0])
        elif i in outputs:
            picked.append(outputs[i])
        else:
            raise ValueError(f"capture_layers: layer {i} not in 0..{max(outputs)}")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        hidden = picked[0] if len(picked) == 1 else gm.graph.call_function(
            torch.ops.aten.cat.default, (picked, -1))
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    out.args = (tuple(results) + (hidden,),)
    return Done(len(picked), f"layers {list(ctx.capture_layers)}")
