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

from specdeploy.deploy.graph import finalize
from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register


def _kernel(target):
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "specdeploy":
        return None
    opdef = OPDEFS.get(target._schema.name)
    return getattr(opdef, "_init_fn", None)


@register("call_kernels_directly", Stage.COMPILE)
def call_kernels_directly(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    if ctx.compile:
        return TransformInfo("call_kernels_directly", Stage.COMPILE, 0, skipped=True,
                             detail="compile=True keeps ops for inductor")
    n = 0
    for node in gm.graph.nodes:
        fn = _kernel(node.target) if node.op == "call_function" else None
        if fn is not None:
            node.target = fn
            n += 1
    finalize(gm)
    return TransformInfo("call_kernels_directly", Stage.COMPILE, n)


@register("compile_model", Stage.COMPILE)
def compile_model(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    if not ctx.compile:
        return TransformInfo("compile_model", Stage.COMPILE, 0, skipped=True,
                             detail="compile=False")
    ctx.compiled = torch.compile(gm, dynamic=True)
    return TransformInfo("compile_model", Stage.COMPILE, 1, detail="torch.compile(dynamic=True)")
