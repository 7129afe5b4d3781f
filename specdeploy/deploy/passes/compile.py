"""Final stage: make the graph cheap to run.

- `call_kernels_directly`: when the graph runs eagerly, calls to `torch.ops.specdeploy.*` become
  direct calls of their Python kernels. The custom-op dispatcher (schema checks, mutation
  bookkeeping, dynamo guards) costs tens of microseconds per call, which at batch size 1 is a
  large part of a step; inside the already-exported graph it buys nothing.
- `compile_model`: optionally wraps the graph with `torch.compile`. Off by default on the CPU:
  inductor's compile time (minutes for a 30-layer model on 2 cores) outweighs its gain for short
  runs. `--compile` turns it on (and keeps the ops as ops, which inductor needs).
"""
from __future__ import annotations

import torch
from torch import fx
from torch._library.custom_ops import OPDEFS

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.pipeline import Done, Stage, register


def _kernel(target):
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "specdeploy":
        return None
    opdef = OPDEFS.get(target._schema.name)
    return getattr(opdef, "_init_fn", None)


@register("call_kernels_directly", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True keeps ops for inductor" if ctx.compile else None)
def call_kernels_directly(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n = 0
    for node in gm.graph.nodes:
        fn = _kernel(node.target) if node.op == "call_function" else None
        if fn is not None:
            node.target = fn
            n += 1
    return Done(n)


@register("compile_model", Stage.COMPILE,
          skip_if=lambda ctx: None if ctx.compile else "compile=False")
def compile_model(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    return Done(1, "torch.compile(dynamic=True)", program=torch.compile(gm, dynamic=True))
