"""Weight-only int8 quantization of `aten.linear` nodes whose weight is a parameter.

Each matched linear becomes `torch.ops.specdeploy.int8_linear(x, w_int8, scale, bias)`; the int8
weight and its per-output-channel scales become buffers of the owning submodule and the fp
weight is deleted from the graph module, so its memory goes once the plain model is dropped (the
runner does not keep it). Exclusions are fnmatch patterns over parameter names, also tried on the
module name (`lm_head` matches `lm_head.weight`).

NOTE (DESIGN.md invariant 6): the drafter of a one-model deployment lives under `eagle_drafter.*`.
Target patterns never match a drafter name and drafter patterns (those starting with
`eagle_drafter`) never match a target name, so e.g. `*.q_proj` excludes the target's q_proj only.
The target modules a drafter graph borrows (`shared_lm_head`, see deploy/spec.py) are judged as
the target's own (`lm_head`).
"""
from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import fx, nn

import specdeploy.ops.quant_linear  # noqa: F401  (registers torch.ops.specdeploy.int8_linear)
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import nodes_calling
from specdeploy.deploy.pipeline import Done, Stage, register
from specdeploy.ops.quant_linear import quantize_int8

DRAFTER_NAMESPACE = "eagle_drafter"
BORROWED_PREFIX = "shared_"  # DraftStep's name for a target module lent to the drafter
METHODS = ("int8",)


def is_excluded(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """True when parameter `name` matches an exclusion pattern of its own namespace."""
    drafter = name == DRAFTER_NAMESPACE or name.startswith(DRAFTER_NAMESPACE + ".")
    if name.startswith(BORROWED_PREFIX):
        name = name[len(BORROWED_PREFIX):]
    module = name.rpartition(".")[0]
    for pat in patterns:
        if pat.startswith(DRAFTER_NAMESPACE) != drafter:
            continue
        if fnmatchcase(name, pat) or (module and fnmatchcase(module, pat)):
            return True
    return False


def _param(gm: fx.GraphModule, node: fx.Node) -> nn.Parameter | None:
    if node.op != "get_attr":
        return None
    mod_name, _, leaf = node.target.rpartition(".")
    owner = gm.get_submodule(mod_name) if mod_name else gm
    return owner._parameters.get(leaf)


def _linear_weight_use(node: fx.Node, weight: fx.Node) -> bool:
    """`node` is a linear that reads `weight` only as its weight argument."""
    return (node.op == "call_function" and node.target is torch.ops.aten.linear.default
            and node.args[1] is weight and node.args[0] is not weight
            and weight not in node.args[2:])


@register("quantize_int8_weights", Stage.QUANTIZE,
          skip_if=lambda ctx: None if ctx.quantize else "quantize=None")
def quantize_int8_weights(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    if ctx.quantize not in METHODS:
        raise ValueError(f"quantize: unsupported method {ctx.quantize!r}; use one of {METHODS}")
    # parameter object → every get_attr node reading it (tied weights may have several names)
    readers: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        p = _param(gm, node)
        if p is not None:
            readers.setdefault(id(p), []).append(node)
    excluded, shared, saved, n = set(), set(), 0, 0
    done: set[fx.Node] = set()
    for lin in nodes_calling(gm, torch.ops.aten.linear):
        if lin in done:  # replaced together with an earlier reader of the same weight
            continue
        w_node = lin.args[1]
        param = _param(gm, w_node)
        if param is None or param.dim() != 2 or not param.dtype.is_floating_point:
            continue
        pname = w_node.target
        aliases = readers[id(param)]
        if any(is_excluded(a.target, ctx.quant_exclude) for a in aliases):
            excluded.add(pname)
            continue
        if not all(_linear_weight_use(u, a) for a in aliases for u in a.users):
            shared.add(pname)  # also read as something other than a linear weight (tied)
            continue
        mod_name, _, leaf = pname.rpartition(".")
        owner = gm.get_submodule(mod_name) if mod_name else gm
        q = quantize_int8(param)
        owner.register_buffer(f"{leaf}_int8", q.weight.to(param.device), persistent=False)
        owner.register_buffer(f"{leaf}_scale", q.scale.to(param.device), persistent=False)
        users = [u for a in aliases for u in a.users]
        done.update(users)
        with gm.graph.inserting_after(aliases[0]):  # aliases are in graph order
            s_node = gm.graph.get_attr(f"{pname}_scale")
            q_node = gm.graph.get_attr(f"{pname}_int8")
        for u in users:
            bias = u.args[2] if len(u.args) > 2 else u.kwargs.get("bias")
            with gm.graph.inserting_before(u):
                new = gm.graph.call_function(torch.ops.specdeploy.int8_linear.default,
                                             (u.args[0], q_node, s_node, bias))
            new.meta.update(u.meta)
            u.replace_all_uses_with(new)
            gm.graph.erase_node(u)
            n += 1
        for a in aliases:
            gm.graph.erase_node(a)
            a_mod, _, a_leaf = a.target.rpartition(".")
            (gm.get_submodule(a_mod) if a_mod else gm)._parameters.pop(a_leaf, None)
        saved += param.numel() * param.element_size() - q.weight.numel() - q.scale.numel() * 4
    detail = f"int8 weight-only, saved {saved / 2**20:.2f} MiB"
    if excluded:
        detail += f"; excluded {len(excluded)} ({', '.join(sorted(excluded)[:3])}"
        detail += ", ...)" if len(excluded) > 3 else ")"
    if shared:
        detail += f"; kept {len(shared)} shared with non-linear uses"
    return Done(n, detail, bytes_saved=saved)
