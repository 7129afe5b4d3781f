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
- `call_aten_directly` (after every pass that matches aten targets): the graph's views, casts
  and elementwise aten calls with a tensor method / torch function of the same arguments (a
  static slice: `torch.narrow`) call that instead of the op overload (its Python wrapper and
  schema binding: `Tensor.view` ~2 us under `aten.view.default` here): the same aten kernels,
  so the same results; ~100 such calls a hybrid's decode step.
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


_aten = torch.ops.aten
# aten overload -> the tensor method / torch function taking the same arguments (the same
# kernel behind it); views and casts first: most of a decode step's aten calls
_METHODS = {
    _aten.view.default: torch.Tensor.view,
    _aten.reshape.default: torch.Tensor.reshape,
    _aten.flatten.using_ints: torch.Tensor.flatten,
    _aten.unsqueeze.default: torch.Tensor.unsqueeze,
    _aten.squeeze.dim: torch.Tensor.squeeze,
    _aten.select.int: torch.Tensor.select,
    _aten.split_with_sizes.default: torch.Tensor.split_with_sizes,
    _aten.to.dtype: torch.Tensor.to,
    _aten.mul.Tensor: torch.mul,
    _aten.add.Tensor: torch.add,
    _aten.relu.default: torch.relu,
    _aten.square.default: torch.square,
}


def _narrow_args(node: fx.Node):
    """aten.slice.Tensor(x, dim, start, end) with step 1 and a static slice inside x's static
    size on `dim`: (x, dim, start, length) for torch.narrow (the same view), else None."""
    a = list(node.args) + [None] * (5 - len(node.args))
    x, dim, start, end, step = a
    if (node.kwargs or step not in (None, 1) or not isinstance(x, fx.Node)
            or not all(isinstance(v, int) for v in (dim, start, end)) or not 0 <= start <= end):
        return None
    if not node.meta.get("slice_in_range"):  # (a fused linear's split: in range as made)
        val = x.meta.get("val")
        size = (val.shape[dim] if isinstance(val, torch.Tensor) and -val.dim() <= dim < val.dim()
                else None)
        if not isinstance(size, int) or end > size:
            return None
    return (x, dim, start, end - start)


@register("call_aten_directly", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True keeps ops for inductor" if ctx.compile else None)
def call_aten_directly(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _aten.slice.Tensor:
            args = _narrow_args(node)
            if args is not None:
                node.target, node.args = torch.narrow, args
                n += 1
            continue
        method = _METHODS.get(node.target)
        if method is not None:
            node.target = method
            n += 1
    gm.recompile()
    return Done(n, f"{n} aten calls through tensor methods (no overload wrapper)")
