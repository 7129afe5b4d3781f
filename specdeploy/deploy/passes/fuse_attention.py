"""Fuse a Llama-type layer's attention glue into one `qkv_attention` op (ops/qkv_attention.py).

Matches `cached_attention(rope(view(X[..., 0:a])), rope(view(X[..., a:b])), view(X[..., b:c]))`
with one cos/sin pair (or without the two ropes: NemotronH's attention; cos and sin None),
where X is a fused q/k/v projection (`ggml_linears` or `fuse_parallel_linears` wrote the
slices) and every intermediate node has no other reader:
nine nodes a layer become one. The fused op gives the chain's bits exactly (its CPU decode /
verify path runs the same C code; anything else runs the chain), so greedy speculation stays
lossless and nothing else in the graph changes. Layers with q/k norms, gates or partial
projections do not match and keep their chain. Attention sinks (gpt-oss; the 14th argument of
`cached_attention`) go along as the fused op's last argument.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import is_op
from specdeploy.deploy.pipeline import Done, Stage, register
from specdeploy.ops import qkv_attention as _qkv  # noqa: F401  (registers the op)

_SLICE = torch.ops.aten.slice.Tensor
_VIEW = torch.ops.aten.view.default
_ROPE = torch.ops.specdeploy.rope
_ATTN = torch.ops.specdeploy.cached_attention
_FUSED = torch.ops.specdeploy.qkv_attention.default


def _sliced_heads(node, x=None):
    """(X, start, end, head size) for view(X[..., start:end], [1, T, -1, D]) read only once."""
    if not (isinstance(node, fx.Node) and node.target is _VIEW and len(node.users) == 1):
        return None
    src, shape = node.args[0], node.args[1]
    if not (isinstance(src, fx.Node) and src.target is _SLICE and len(src.users) == 1):
        return None
    args = tuple(src.args) + (None,) * (4 - len(src.args))
    _, dim, start, end = args[:4]
    if dim != -1 or not isinstance(start, int) or not isinstance(end, int) or src.kwargs:
        return None
    if not (isinstance(shape, (list, tuple)) and len(shape) == 4 and shape[0] == 1
            and shape[2] == -1 and isinstance(shape[3], int)):
        return None
    if x is not None and src.args[0] is not x:
        return None
    return src.args[0], start, end, shape[3]


def _roped(node):
    """(sliced heads, cos, sin) for rope(view(slice)) read only once."""
    if not (isinstance(node, fx.Node) and is_op(node, _ROPE) and len(node.users) == 1):
        return None
    heads = _sliced_heads(node.args[0])
    return None if heads is None else (heads, node.args[1], node.args[2])


def _width(x: fx.Node, end: int) -> int | None:
    """X's last dim where known (its fake value), else the v slice's end when that is a real
    bound (the linear fusions write exact ends; the op reads v up to there, not X's end)."""
    val = x.meta.get("val")
    if val is not None and val.dim() == 3 and isinstance(val.shape[-1], int):
        return min(int(val.shape[-1]), end)
    return end if end < 2 ** 31 else None


def _match(attn: fx.Node):
    if len(attn.args) not in (13, 14) or attn.kwargs:
        return None
    q, k, v = attn.args[:3]
    rq, rk = _roped(q), _roped(k)
    if rq is None and rk is None:  # no RoPE
        hq_, hk_ = _sliced_heads(q), _sliced_heads(k)
        if hq_ is None or hk_ is None:
            return None
        rq, rk = (hq_, None, None), (hk_, None, None)
    elif rq is None or rk is None or rq[1:] != rk[1:]:
        return None
    (x, q0, q1, d), (xk, k0, k1, dk) = rq[0], rk[0]
    vh = _sliced_heads(v, x)
    if vh is None or xk is not x or dk != d:
        return None
    _, v0, v1, dv = vh
    width = _width(x, v1)
    hq, hkv = (q1 - q0) // d, (k1 - k0) // d
    if width is None or (q0, k0, v0) != (0, q1, k1) or (q1 - q0) % d or (k1 - k0) % d:
        return None
    if not hkv or (width - v0) != hkv * dv or hq % hkv:
        return None
    return x, rq[1], rq[2], hq, hkv, d, (q, k, v)


@register("fuse_rope_attention", Stage.OPTIMIZE)
def fuse_rope_attention(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n = 0
    for attn in [node for node in gm.graph.nodes if is_op(node, _ATTN)]:
        found = _match(attn)
        if found is None:
            continue
        x, cos, sin, hq, hkv, d, (q, k, v) = found
        rest, sinks = attn.args[3:13], attn.args[13:]  # sinks: () or (node or None,)
        sinks = sinks if sinks and sinks[0] is not None else ()
        with gm.graph.inserting_before(attn):
            fused = gm.graph.call_function(_FUSED, (x, cos, sin, *rest, hq, hkv, d, *sinks))
        if "val" in attn.meta:
            fused.meta["val"] = attn.meta["val"]
        attn.replace_all_uses_with(fused)
        gm.graph.erase_node(attn)
        for rope in (q, k):  # [rope ->] view -> slice, each read by the next only
            view = rope
            if is_op(rope, _ROPE):
                view = rope.args[0]
                gm.graph.erase_node(rope)
            sl = view.args[0]
            gm.graph.erase_node(view)
            gm.graph.erase_node(sl)
        sl = v.args[0]
        gm.graph.erase_node(v)
        gm.graph.erase_node(sl)
        n += 1
    gm.graph.lint()
    gm.recompile()
    return Done(n, f"{n} attention layers: q/k/v slices, RoPE (if any) and cached attention in "
                   "one op")
