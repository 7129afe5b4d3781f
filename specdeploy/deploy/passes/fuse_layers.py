"""One graph call per Llama-type decoder layer on the CPU fast path (ops/layer_rows.py).

Matches, from a layer's q/k/v projection to the next norm, the chain the optimize stage leaves
when the linears run on tiled GGUF weights (`kernels="fast"`) and the compile stage made the
ops direct kernel calls:
    qkv = linear(normed); a = qkv_attention(qkv, ...); a = reshape(a, shape); o = linear(a);
    (res2, normed2) = add_rms_norm(res, o); gu = linear(normed2); m = silu_mul(gu, n);
    dn = linear(m); add_rms_norm(res2, dn, w_next)
where every node but the last has no reader outside the chain and each linear is a bias-free
tiled-kernel closure whose sizes line up. The last node becomes one call of the fused layer,
whose getitems the graph keeps. The fused layer calls the same C kernels with the same
arguments (the chain's bits) and runs the chain itself where its fast path does not apply.
The q/k/v projection may read a wider input than the hidden size: the EAGLE-3 drafter's layer
(`eagle_drafter.midlayer`) projects cat(input_layernorm(embeds), hidden_norm(hidden)), 2H wide,
and adds the attention to the un-normed hidden; where its linears run on tiled blocks
(`draft_quantize="q8_0"`) it matches too. Its fp32 linears (the default drafter) are oneDNN
calls, not tiled ones, and keep their chain.
A layer that does not match keeps its chain; `kernels="exact"` has no tiled linears, so no
layer matches there.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import layer_rows
from specdeploy.ops.fused_rows import _add_rms_norm_kernel, _silu_mul_kernel
from specdeploy.ops.qkv_attention import _qkv_attention_kernel

_RESHAPE = torch.ops.aten.reshape.default


def _call(node, target=None, nargs=None) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and not node.kwargs
            and (target is None or node.target is target)
            and (nargs is None or len(node.args) == nargs))


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return len(node.users) == 1 and reader in node.users


def _tiled(node) -> bool:
    call = getattr(node.target, "tiled_call", None) if _call(node, nargs=1) else None
    return call is not None and call.bias is None


def _halves(norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(sum, normed): the two getitems of an add_rms_norm, its only readers."""
    items = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
    if len(items) != 2 or len(norm.users) != 2 or set(items) != {0, 1}:
        return None
    return items[0], items[1]


def _match(attn: fx.Node):
    """The chain around one `qkv_attention` call, or None."""
    if not _call(attn, _qkv_attention_kernel, 16) or attn.args[1] is None:  # None: no RoPE
        return None
    qkv, rest = attn.args[0], attn.args[1:]
    hq, hkv, d, scale = rest[-3], rest[-2], rest[-1], rest[9]
    if not (_tiled(qkv) and _only_reader(qkv, attn) and len(attn.users) == 1
            and all(isinstance(x, int) for x in (hq, hkv, d)) and isinstance(scale, float)):
        return None
    (reshape,) = attn.users
    if not (_call(reshape, _RESHAPE, 2) and reshape.args[0] is attn and len(reshape.users) == 1):
        return None
    (o,) = reshape.users
    if not (_tiled(o) and len(o.users) == 1):
        return None
    (post,) = o.users
    if not (_call(post, _add_rms_norm_kernel, 4) and post.args[1] is o
            and isinstance(post.args[3], float)):
        return None
    halves = _halves(post)
    if halves is None or len(halves[0].users) != 1 or len(halves[1].users) != 1:
        return None
    (gu,) = halves[1].users
    if not (_tiled(gu) and gu.args[0] is halves[1] and len(gu.users) == 1):
        return None
    (silu,) = gu.users
    if not (_call(silu, _silu_mul_kernel, 2) and silu.args[0] is gu
            and isinstance(silu.args[1], int) and len(silu.users) == 1):
        return None
    (dn,) = silu.users
    if not (_tiled(dn) and len(dn.users) == 1):
        return None
    (nxt,) = dn.users
    if not (_call(nxt, _add_rms_norm_kernel, 4) and nxt.args[0] is halves[0]
            and nxt.args[1] is dn and isinstance(nxt.args[3], float)):
        return None
    calls = tuple(n.target.tiled_call for n in (qkv, o, gu, dn))
    h, n_ff = calls[1].n, silu.args[1]
    # NOTE: q/k/v may read a wider input than H: the EAGLE-3 layer's cat(embeds, hidden), 2H
    if not (calls[0].k >= h == calls[2].k == calls[3].n and calls[3].k == n_ff
            and calls[2].n >= 2 * n_ff):
        return None
    return (qkv, attn, reshape, o, post, *halves, gu, silu, dn, nxt), calls


def _read_by_next(chain: tuple, following: tuple | None) -> bool:
    """Whether the layer's two results are read by the next matched layer only (its residual
    add and its q/k/v projection): then they may live in a buffer reused two layers on."""
    if following is None:
        return False
    nxt, (qkv, post) = chain[-1], (following[0], following[4])
    halves = _halves(nxt)
    return (halves is not None and set(halves[0].users) == {post} and post.args[0] is halves[0]
            and set(halves[1].users) == {qkv} and qkv.args[0] is halves[1])


def _fuse(gm: fx.GraphModule, chain: tuple, calls: tuple, shared: layer_rows.Shared,
          out_parity: int | None) -> None:
    qkv, attn, reshape, o, post, res2, normed2, gu, silu, dn, nxt = chain
    rest = attn.args[1:]
    callables = layer_rows.LayerChain(qkv.target, attn.target, reshape.target, o.target,
                                      post.target, gu.target, silu.target, dn.target, nxt.target)
    fn = layer_rows.decoder_layer_fn(callables, calls, shared, hq=rest[-3], hkv=rest[-2],
                                     d=rest[-1], n_ff=silu.args[1], scale=rest[9],
                                     eps_post=post.args[3], eps_next=nxt.args[3],
                                     out_parity=out_parity)
    fn.__name__ = fn.__qualname__ = "decoder_layer"  # the graph's node names
    args = (post.args[0], qkv.args[0], *rest, reshape.args[1], post.args[2], post.args[3],
            silu.args[1], nxt.args[2], nxt.args[3])
    with gm.graph.inserting_before(nxt):
        fused = gm.graph.call_function(fn, args)
    if "val" in nxt.meta:
        fused.meta["val"] = nxt.meta["val"]
    nxt.replace_all_uses_with(fused)
    for node in reversed(chain):
        gm.graph.erase_node(node)


@register("fuse_decoder_layers", Stage.COMPILE,
          skip_if=lambda ctx: "compile=True keeps ops for inductor" if ctx.compile else None)
def fuse_decoder_layers(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    found = [m for m in map(_match, list(gm.graph.nodes)) if m is not None]
    if not found:
        return Done(0, "no layer on tiled linears")
    why = layer_rows.unavailable()
    if why is not None:
        return Skipped(f"fused layer kernel unavailable: {why}")
    shared = layer_rows.Shared()  # NOTE: one scratch per graph: its layers run in turn
    # NOTE: decided before any rewrite, on the chains' own nodes; parity by position, so a
    # layer never writes the pair it reads
    reuse = [_read_by_next(c, f[0] if f else None)
             for (c, _), f in zip(found, [*found[1:], None])]
    for i, ((chain, calls), held) in enumerate(zip(found, reuse)):
        _fuse(gm, chain, calls, shared, i % 2 if held else None)
    gm.graph.lint()
    gm.recompile()
    return Done(len(found), f"{len(found)} decoder layers in one C call each, "
                            f"{sum(reuse)} writing reused buffers")
