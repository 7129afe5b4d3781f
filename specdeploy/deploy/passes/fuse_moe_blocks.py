"""`fuse_moe_blocks`: a MoE layer's block in one graph call on the CPU fast path (ops/moe_block.py).

Matched from the routed experts' one-call closure (`kernels="fast"`: ops/ggml_moe_int.py) out to
the add of the shared expert, after the compile stage made the ops direct kernel calls:
    x2 = reshape(x, [-1, H])                        (optional)
    (ids, wts) = route(router(x2))                  route_sigmoid (+ bias, groups) / softmax top-k
    e = [lat_out](experts([lat_in](x2), ids, wts))  [view to x's shape]
    s = sh_down(relu(.)^2 | silu_mul(sh_up(x2 or x)))
    [s = sigmoid_rows(gate(x2 or x)) * s]
    out = e + s
where every node but the add has no reader outside the chain and each linear is a closure
whose kernel call the fused block can make (tiled or integer block kernels without a bias, the
batch-invariant fp32 linear). The add becomes one call of the fused block. Blocks that do not
match (the fp32 experts of a safetensors model, a bias, a routing the C kernel refuses) keep
their chain; so does every step the fused call does not take (it runs the chain's callables).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.passes.chain_fusion import _fuse, _skip
from specdeploy.deploy.passes.row_linears import sigmoid_rows
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import moe_block
from specdeploy.ops.fused_rows import _silu_mul_kernel
from specdeploy.ops.moe import _sigmoid_kernel, _softmax_topk_kernel

_aten = torch.ops.aten


def _call(node, target=None, nargs=None) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and not node.kwargs
            and (target is None or node.target is target)
            and (nargs is None or len(node.args) == nargs))


def _linear(node) -> moe_block.LinearCall | None:
    return moe_block.linear_call(node.target) if _call(node, nargs=1) else None


def _cast(node) -> bool:
    """An fp32 cast (an identity on the fp32 tensors the fused call takes)."""
    return _call(node, _aten.to.dtype, 2) and node.args[1] is torch.float32


def _uncast(node, chain: list):
    """`node` past its fp32 casts, which join the chain."""
    while _cast(node):
        chain.append(node)
        node = node.args[0]
    return node


def _route(ids: fx.Node, wts: fx.Node):
    """(route node, sigmoid?, the fp32 cast between, if any) where ids / wts are its getitems
    0 / 1, its only readers (the weights maybe through a cast to fp32, which they are)."""
    cast = None
    if _cast(wts) and len(wts.users) == 1:
        cast, wts = wts, wts.args[0]
    if not (_call(ids, operator.getitem, 2) and _call(wts, operator.getitem, 2)
            and ids.args[0] is wts.args[0] and (ids.args[1], wts.args[1]) == (0, 1)):
        return None
    route = ids.args[0]
    if _call(route, _sigmoid_kernel) and len(route.args) in (6, 7):  # 6: the default scale
        sig = True
    elif _call(route, _softmax_topk_kernel, 3):
        sig = False
    else:
        return None
    if set(route.users) != {ids, wts} or len(wts.users) != 1:
        return None
    return route, sig, cast


def _routing_consts(route: fx.Node, sig: bool, e: int) -> tuple | None:
    """(k, n_group, topk_group, renorm, scale) where row_kernels.moe_route takes them (else the
    chain's routing would be torch's, which the fused call does not reproduce)."""
    if sig:
        _, bias, k, ng, tg, renorm, scale = (*route.args, 1.0)[:7]
        if bias is not None and not isinstance(bias, fx.Node):
            return None
    else:
        _, k, renorm = route.args
        ng, tg, scale = 1, 1, 1.0
    if not (isinstance(k, int) and isinstance(ng, int) and isinstance(tg, int)
            and isinstance(renorm, bool) and isinstance(scale, (int, float))):
        return None
    if not 0 < k <= min(e, 64):
        return None
    if ng > 1 and (e % ng or e // ng < 2 or not 0 < tg <= ng or k > tg * (e // ng)):
        return None
    return k, ng, tg, renorm, float(scale)


def _match(experts: fx.Node):
    """(chain nodes in graph order, x node, corr node or None, Parts, rows-only output)."""
    call = getattr(experts.target, "moe_call", None) if _call(experts, nargs=3) else None
    if call is None or len(experts.users) != 1:
        return None
    xe, ids, wts = experts.args
    r = _route(ids, wts)
    if r is None:
        return None
    route, sig, cast = r
    router = route.args[0]
    rc = _linear(router)
    if rc is None or set(router.users) != {route}:
        return None
    chain = [router, route, ids, wts, experts] if cast is None else [
        router, route, ids, cast.args[0], cast, experts]
    x2 = _uncast(router.args[0], chain)
    xe = _uncast(xe, chain)
    lat_in = None
    if xe is not x2:
        lat_in = _linear(xe)
        if lat_in is None or _uncast(xe.args[0], chain) is not x2 or set(xe.users) != {experts}:
            return None
        chain.append(xe)
    # the experts' side: [lat_out] [view]
    side, lat_out = experts, None
    (nxt,) = side.users
    if _linear(nxt) is not None:
        lat_out, side = _linear(nxt), nxt
        chain.append(nxt)
        if len(side.users) != 1:
            return None
        (nxt,) = side.users
    viewed = _call(nxt, _aten.view.default, 2) and len(nxt.users) == 1
    if viewed:
        chain.append(nxt)
        side = nxt
        (nxt,) = nxt.users
    add = nxt
    if not (_call(add, _aten.add.Tensor, 2) and side in add.args
            and add.args[0] is not add.args[1]):
        return None
    s = add.args[1] if add.args[0] is side else add.args[0]
    # the shared expert's side: [gate *] down(act(up(x)))
    gate = None
    if _call(s, _aten.mul.Tensor, 2) and len(s.users) == 1:
        g, down = s.args
        if not _call(g, sigmoid_rows, 1):
            g, down = down, g
        if not (_call(g, sigmoid_rows, 1) and len(g.users) == 1):
            return None
        gl = g.args[0]
        gate = _linear(gl)
        if gate is None or len(gl.users) != 1:
            return None
        chain += [s, g, gl]
        gate_x = _uncast(gl.args[0], chain)
    else:
        down, gate_x = s, None
    sh_down = _linear(down)
    if sh_down is None or len(down.users) != 1:
        return None
    act = down.args[0]
    chain.append(down)
    if _call(act, _silu_mul_kernel, 2) and isinstance(act.args[1], int):
        up, sh_act, sh_ff = act.args[0], moe_block.SWIGLU, act.args[1]
        chain.append(act)
    elif _call(act, _aten.square.default, 1) and _call(act.args[0], _aten.relu.default, 1):
        relu = act.args[0]
        if len(relu.users) != 1:
            return None
        up, sh_act, sh_ff = relu.args[0], moe_block.RELU2, 0
        chain += [act, relu]
    else:
        return None
    if len(act.users) != 1:
        return None
    sh_up = _linear(up)
    if sh_up is None or len(up.users) != 1:
        return None
    chain.append(up)
    up_x = _uncast(up.args[0], chain)
    # the block's input: x2, or the tensor x2 reshapes (read by some linears directly)
    x = x2
    if _call(x2, _aten.reshape.default, 2) or _call(x2, _aten.view.default, 2):
        chain.append(x2)
        x = _uncast(x2.args[0], chain)
    if not all(a in (x, x2) for a in (up_x, gate_x) if a is not None):
        return None
    consts = _routing_consts(route, sig, rc.n)
    if consts is None:
        return None
    k, ng, tg, renorm, scale = consts
    parts = moe_block.Parts(rc, lat_in, lat_out, sh_up, sh_down, gate, experts.target, sig, k,
                            ng, tg, renorm, scale, sh_act, sh_ff)
    if not moe_block.parts_fit(parts):
        return None
    chain.append(add)
    chain = list(dict.fromkeys(chain))  # (a cast reached twice)
    inside = set(chain)
    if any(not set(n.users) <= inside for n in chain[:-1]):
        return None
    order = {n: i for i, n in enumerate(add.graph.nodes)}
    chain.sort(key=order.__getitem__)
    if chain[-1] is not add:
        return None
    corr = route.args[1] if sig else None
    # the add's shape: x's where a side reads x itself or views to it, else [R, H]
    rows_only = x is x2 or not (viewed or up_x is x or gate_x is x)
    return chain, x, corr, parts, rows_only


@register("fuse_moe_blocks", Stage.COMPILE, skip_if=_skip)
def fuse_moe_blocks(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    found = [m for m in map(_match, list(gm.graph.nodes)) if m is not None]
    if not found:
        return Done(0, "no MoE block on the fast kernels")
    why = moe_block.unavailable()
    if why is not None:
        return Skipped(f"fused MoE block kernel unavailable: {why}")
    for chain, x, corr, parts, rows_only in found:
        known = [x] if corr is None else [x, corr]

        def fn_of(sub, _consts, parts=parts, corr=corr, rows_only=rows_only):
            return moe_block.moe_block_fn(parts, sub, 0, None if corr is None else 1, rows_only)

        _fuse(gm, chain, known, fn_of, {}, "moe_block")
    gm.graph.lint()
    gm.recompile()
    return Done(len(found), f"{len(found)} MoE blocks in one call each")

