"""On a GPU, fuse each RMSNorm with the one linear that reads it (and the SiLU-gated product
after a fused gate/up projection) into one op: `norm_linear` / `add_norm_linear`
(ops/norm_linear.py, whose docstring says why and when its kernel runs).

Matches `rms_norm(x)` or `add_rms_norm(a, b)[1]` whose only reader is a float `linear` of a
weight (and bias) the graph holds, and, when that linear's only reader is `silu_mul(y, n)` with
2n outputs, that too. Runs after `fuse_row_ops` (which makes the add + norm and SiLU-gated
nodes) and the linear fusions (q/k/v, gate/up). Quantized linears are other ops by then and are
left alone. On the CPU (where the decoder-layer fusion does this and more) it skips, but under
Triton's interpreter (TRITON_INTERPRET=1), where the tests run the GPU kernels on CPU tensors.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor, is_op
from specdeploy.deploy.pipeline import Done, Stage, register
from specdeploy.ops import gpu_kernels

_LINEAR = torch.ops.aten.linear.default
_NORM = torch.ops.specdeploy.rms_norm
_ADD_NORM = torch.ops.specdeploy.add_rms_norm
_SILU_MUL = torch.ops.specdeploy.silu_mul


def _skip(ctx: DeployContext) -> str | None:
    if ctx.compile:
        return "compile=True: inductor fuses the norms itself"
    if ctx.device.type != "cuda" and not gpu_kernels.INTERPRET:
        return f"a GPU kernel; device is {ctx.device}"
    return None


def _source(node: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(the norm or add + norm node, the getitem of its sum or None) when `node` is a normed
    output: rms_norm's result, or add_rms_norm's [1]."""
    if is_op(node, _NORM):
        return node, None
    if (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1
            and isinstance(node.args[0], fx.Node) and is_op(node.args[0], _ADD_NORM)):
        fused = node.args[0]
        sums = [u for u in fused.users if u.target is operator.getitem and u.args[1] == 0]
        if len(sums) <= 1 and len(fused.users) == len(sums) + 1:
            return fused, (sums[0] if sums else None)
    return None


def _linear_of(gm: fx.GraphModule, normed: fx.Node):
    """(linear node, weight, bias node or None) for the one float linear reading `normed`."""
    if len(normed.users) != 1:
        return None
    lin = next(iter(normed.users))
    if lin.op != "call_function" or lin.target is not _LINEAR or lin.args[0] is not normed \
            or lin.kwargs:
        return None
    w = attr_tensor(gm, lin.args[1])
    bias = lin.args[2] if len(lin.args) > 2 else None
    if w is None or w.dim() != 2 or not w.is_floating_point() or \
            (bias is not None and attr_tensor(gm, bias) is None):
        return None
    return lin, w, bias


def _glu_of(lin: fx.Node, w: torch.Tensor) -> tuple[fx.Node, int] | None:
    if len(lin.users) != 1:
        return None
    user = next(iter(lin.users))
    if is_op(user, _SILU_MUL) and user.args[0] is lin and isinstance(user.args[1], int) \
            and 2 * user.args[1] == w.shape[0]:
        return user, user.args[1]
    return None


@register("fuse_norm_linears", Stage.OPTIMIZE, skip_if=_skip)
def fuse_norm_linears(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    plain = glus = 0
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        found = _source(node) if node not in erased and node.op == "call_function" else None
        lin = _linear_of(gm, node) if found else None
        if lin is None:
            continue
        (norm, sums), (linear, w, bias) = found, lin
        glu = _glu_of(linear, w)
        last, n = glu if glu else (linear, 0)
        graph = gm.graph
        with graph.inserting_before(norm):  # every input exists here; the weights re-read
            w_node = graph.get_attr(linear.args[1].target)
            b_node = None if bias is None else graph.get_attr(bias.target)
            if sums is None and norm is node:  # rms_norm(x, weight, eps)
                x, nw, eps = norm.args[:3]
                y = graph.call_function(torch.ops.specdeploy.norm_linear.default,
                                        (x, nw, eps, w_node, b_node, n))
                total = None
            else:  # add_rms_norm(a, b, weight, eps)
                a, b, nw, eps = norm.args[:4]
                fused = graph.call_function(torch.ops.specdeploy.add_norm_linear.default,
                                            (a, b, nw, eps, w_node, b_node, n))
                total = graph.call_function(operator.getitem, (fused, 0))
                y = graph.call_function(operator.getitem, (fused, 1))
        if "val" in last.meta:
            y.meta["val"] = last.meta["val"]
        last.replace_all_uses_with(y)
        if sums is not None:
            total.meta.update({k: v for k, v in sums.meta.items() if k == "val"})
            sums.replace_all_uses_with(total)
        for dead in ([last, linear] if glu else [linear]) + ([node] if node is not norm else []) \
                + ([sums] if sums is not None else []) + [norm]:
            graph.erase_node(dead)
            erased.add(dead)
        glus += bool(glu)
        plain += not glu
    return Done(plain + glus, f"{plain} norm + linear, {glus} norm + gate/up + SiLU-gated product")
