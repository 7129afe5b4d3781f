"""Replacing a matched chain of FX nodes by one call that falls back to the chain itself
(fuse_mixers.py, fuse_moe_blocks.py): the fallback `_Sub` (the chain's targets replayed on the
fused call's arguments), the rewrite `_fuse` and its skip rule, and fuse_mixers' small node
predicates.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext


def _call(node, target) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and not node.kwargs)


def _only(node: fx.Node, reader: fx.Node) -> bool:
    return isinstance(node, fx.Node) and set(node.users) == {reader}


def _shape(node: fx.Node) -> tuple | None:
    v = node.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


class _Ref:
    __slots__ = ("own", "i")

    def __init__(self, own: bool, i: int):
        self.own, self.i = own, i


class _Sub:
    """The matched nodes as a plain function of the fused call's arguments (the fallback)."""

    def __init__(self, chain: list[fx.Node], ext: list):
        pos: dict[fx.Node, int] = {}
        for i, a in enumerate(ext):
            if isinstance(a, fx.Node):
                pos.setdefault(a, i)
        own = {n: i for i, n in enumerate(chain)}
        self.steps = [(n.target, fx.node.map_arg(
            n.args, lambda m: _Ref(True, own[m]) if m in own else _Ref(False, pos[m])))
            for n in chain]

    def held_callables(self) -> list:
        """What the fallback calls (deploy/memory.py counts the weights they hold)."""
        return [target for target, _ in self.steps]

    def __call__(self, ext: tuple):
        vals: list = []

        def get(a):
            if isinstance(a, _Ref):
                return vals[a.i] if a.own else ext[a.i]
            if isinstance(a, tuple):
                return tuple(get(x) for x in a)
            if isinstance(a, list):
                return [get(x) for x in a]
            return a

        for target, args in self.steps:
            vals.append(target(*[get(a) for a in args]))
        return vals[-1]


def _external(chain: list[fx.Node], known: list) -> list:
    """`known` then every other node the chain reads from outside it, in order of appearance."""
    inside, ext = set(chain), list(known)
    seen = {a for a in known if isinstance(a, fx.Node)}
    for n in chain:
        for a in n.all_input_nodes:
            if a not in inside and a not in seen:
                seen.add(a)
                ext.append(a)
    return ext


def _fuse(gm: fx.GraphModule, chain: list[fx.Node], known: list, fn_of, consts: dict,
          name: str) -> None:
    ext = _external(chain, known)
    fn = fn_of(_Sub(chain, ext), consts)
    fn.__name__ = fn.__qualname__ = name  # the graph's node names
    last = chain[-1]
    with gm.graph.inserting_before(last):
        fused = gm.graph.call_function(fn, tuple(ext))
    fused.meta = dict(last.meta)
    last.replace_all_uses_with(fused)
    for node in reversed(chain):
        gm.graph.erase_node(node)


def _skip(ctx: DeployContext) -> str | None:
    if ctx.compile:
        return "compile=True keeps ops for inductor"
    if torch.device(ctx.device).type != "cpu":
        return f"CPU kernels; the graph runs on {ctx.device}"
    return None
