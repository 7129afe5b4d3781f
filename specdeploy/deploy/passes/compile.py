"""Final stage: make the graph cheap to run.

- `call_kernels_directly`: when the graph runs eagerly, calls to `torch.ops.specdeploy.*` become
  direct calls of their Python kernels. The custom-op dispatcher (schema checks, mutation
  bookkeeping, dynamo guards) costs tens of microseconds per call, which at batch size 1 is a
  large part of a step; inside the already-exported graph it buys nothing.
- `compile_model`: optionally wraps the graph with `torch.compile`. Off by default on the CPU:
  inductor's compile time (minutes for a 30-layer model on 2 cores) outweighs its gain for short
  runs. `--compile` turns it on (and keeps the ops as ops, which inductor needs).
- `flatten_attrs`: when the graph runs eagerly, each weight the graph reads from a submodule
  (`self.model.layers.3.input_layernorm.weight`: four `nn.Module.__getattr__` calls, ~1 us each,
  ~360 a decode step on the default model) is read through one plain attribute of the graph
  module instead. The tensors are the same objects, still registered where they were (state
  dicts, parameter counts and in-place updates see them); only replacing a parameter object
  after deployment would go unseen, and nothing does that.
- `fuse_decoder_layers` (fuse_layers.py, between these two and `compile_model`): on the tiled
  GGUF kernels, each Llama-type layer's remaining ~9 direct kernel calls become one C call.
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


@register("flatten_attrs", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True traces attributes itself" if ctx.compile else None)
def flatten_attrs(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr" or "." not in node.target:
            continue
        value = _resolve(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        flat = "_flat_" + node.target.replace(".", "_")
        gm.__dict__[flat] = value  # NOTE: a plain attribute: found without __getattr__
        node.target = flat
        n += 1
    gm.recompile()
    return Done(n, f"{n} submodule tensors read through plain attributes")


def _resolve(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@register("compile_model", Stage.COMPILE,
          skip_if=lambda ctx: None if ctx.compile else "compile=False")
def compile_model(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    return Done(1, "torch.compile(dynamic=True)", program=torch.compile(gm, dynamic=True))
