"""`drop_identity_ops`: remove graph nodes that provably return their input unchanged.

What export and the earlier passes leave: `aten.alias`, and `to` casts to the dtype, device and
layout the tensor already has, whatever its shape, symbolic too (an EAGLE-3 drafter casts its
fp32 embedding and rope frequencies to fp32: four of them a draft step; a MoE layer's fp32
routing, three), and `view` / `reshape` to the static shape the tensor has.
Each costs a dispatch (a few microseconds at batch size 1) and returns `self` or a view of the
same memory, so its readers may read the input itself. Only static facts decide: the input's
and the node's recorded `val` (dtype, device, layout, an all-int shape) and the call's own
arguments; `copy=True`, a memory format, `contiguous` and `clone` (which a later in-place write
could tell apart) are kept. Runs last, so no fusion pattern ever misses a node it expects.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import op_args
from specdeploy.deploy.pipeline import Done, Stage, register

_aten = torch.ops.aten
_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default}
_VIEWS = {_aten.view.default, _aten.reshape.default}


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _static(shape) -> tuple[int, ...] | None:
    dims = tuple(shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def is_identity(node: fx.Node) -> bool:
    """Whether `node` returns its first argument's values, dtype, device and shape unchanged
    (and aliases it, as the op itself would, or is a cast that returns `self`)."""
    if node.op != "call_function" or not node.args:
        return False
    src, out, t = node.args[0], _val(node), node.target
    inp = _val(src)
    if t is _aten.alias.default:
        return isinstance(src, fx.Node)
    if inp is None or out is None or (t not in _CASTS and t not in _VIEWS):
        return False
    if out.dtype != inp.dtype or out.device != inp.device or out.layout != inp.layout:
        return False
    a = op_args(node)
    if t in _VIEWS:
        return (_static(out.shape) is not None and _static(out.shape) == _static(inp.shape)
                and _static(a["size"] if "size" in a else a["shape"]) == _static(inp.shape))
    if t is _aten._to_copy.default:  # always a copy: a later write could tell it apart
        return False
    fmt = a.get("memory_format")
    return (not a.get("copy", False) and fmt in (None, torch.preserve_format)
            and a.get("dtype") in (None, inp.dtype)
            and a.get("device") in (None, inp.device, str(inp.device))
            and a.get("layout") in (None, inp.layout))


@register("drop_identity_ops", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True: inductor drops them itself" if ctx.compile else None)
def drop_identity_ops(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    names = []
    for node in list(gm.graph.nodes):
        if is_identity(node):
            node.replace_all_uses_with(node.args[0])
            names.append(str(node.target).removeprefix("aten."))
            gm.graph.erase_node(node)
    kinds = sorted(set(names))
    return Done(len(names), f"{len(names)} no-op calls ({', '.join(kinds)})" if names else "")
