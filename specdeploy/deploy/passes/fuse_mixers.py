"""`fuse_recurrent_mixers`: a Mamba2 or gated-delta mixer's decode step in one C call.

Between its in_proj and out_proj a recurrent mixer runs ~11 (Mamba2) to ~20 (gated delta)
graph nodes on the CPU: the cached conv1d, a split into heads (getitems, reshapes, the q / k
heads' repeat), the step's inputs (softplus, sigmoid, the decay product), the cached scan and
the gated RMSNorm. At batch 1 their dispatch and the two state gathers cost more than the
math, and a verify step ran them token by token in Python (a 4-token verify of a Qwen3.5
GGUF cost ~3.6 decode steps). Matched from the gated norm back to the cached conv (every inner
node read only inside the chain), the chain becomes one call that runs row_kernels.c
`mamba2_decode_rows` / `gdn_decode_rows` for a step of decodes only (one token each, the states
updated in place: what `run_cached` takes its in-place path for) or of verify segments only
(all of one length: each sequence's tokens in turn, the state after each into its spec-state
entries, as run_cached's EXTEND path), every sequence with a cached state and no prefix-cache
checkpoint: the chain's own kernels in its order on the same values, so the same bits. Any
other step (prefill, mixed) runs the original nodes, unchanged.

Matched shapes (what the models' code exports):
  Mamba2 (NemotronH): conv(xbc) -> split(x, B, C) -> reshape x3 -> ssm_scan(x, dt, A, B, C, ..)
    -> reshape -> gated_rms_norm(., z, norm_before_gate=False)
  gated delta (Qwen3.5): conv(qkv) -> split(q, k, v) -> reshape x3 -> [repeat_interleave q, k]
    -> gated_delta_rule(q, k, v, A * softplus(a + dt_bias), sigmoid(b), ..)
    -> gated_rms_norm(., z, norm_before_gate=True)
Compile stage, after the direct kernel calls (it matches those), on the eager graph only.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.passes.chain_fusion import _call, _fuse, _only, _shape, _skip
from specdeploy.deploy.passes.compile import _kernel
from specdeploy.deploy.passes.identity import is_identity
from specdeploy.deploy.passes.mixer_calls import _gdn_fn, _mamba2_fn
from specdeploy.deploy.passes.row_linears import sigmoid_rows, softplus_rows
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import row_kernels
from specdeploy.ops.norm import _gated_rms_norm_kernel

_ops = torch.ops.specdeploy
_aten = torch.ops.aten
_CONV_ARGS, _SSM_ARGS, _GDN_ARGS = 13, 19, 17  # with the prefix cache's three (else 3 fewer)


def _args(node: fx.Node, full: int) -> list | None:
    """The call's arguments padded to `full` (a graph without the prefix cache passes no
    checkpoint arguments: None)."""
    a = list(node.args)
    if len(a) == full - 3:
        a += [None] * 3
    return a if len(a) == full else None


def _split3(conv: fx.Node, parts: list[fx.Node]) -> bool:
    """parts are getitem 0, 1, 2 of one split_with_sizes(conv, sizes, -1), its only readers."""
    split = parts[0].args[0] if _call(parts[0], operator.getitem) else None
    if not (_call(split, _aten.split_with_sizes.default) and split.args[0] is conv
            and _only(conv, split) and len(split.args) == 3 and split.args[2] in (-1, 2)
            and len(split.users) == 3):
        return False
    return all(_call(p, operator.getitem) and p.args == (split, i) and len(p.users) == 1
               for i, p in enumerate(parts))


def _reshaped(node, reader) -> fx.Node | None:
    """The reshape(getitem, shape) `node` (read by `reader` only): its getitem."""
    if _call(node, _aten.reshape.default) and _only(node, reader):
        return node.args[0]
    return None


def _match_mamba2(gn: fx.Node, conv_fn, ssm_fn):
    if not (_call(gn, _gated_rms_norm_kernel) and len(gn.args) == 6 and gn.args[5] is False):
        return None
    ry = gn.args[0]
    if not (_call(ry, _aten.reshape.default) and _only(ry, gn)):
        return None
    ssm = ry.args[0]
    if not (_call(ssm, ssm_fn) and _only(ssm, ry)):
        return None
    sa = _args(ssm, _SSM_ARGS)
    if sa is None:
        return None
    parts = [_reshaped(sa[i], ssm) for i in (0, 3, 4)]
    if None in parts or len({id(p) for p in parts}) != 3:
        return None
    conv = parts[0].args[0].args[0] if _call(parts[0], operator.getitem) else None
    if not (_call(conv, conv_fn) and _split3(conv, parts)):
        return None
    ca = _args(conv, _CONV_ARGS)
    if ca is None or ca[9] != "silu":
        return None
    xs, bs = _shape(sa[0]), _shape(sa[3])
    if xs is None or bs is None or not all(isinstance(d, int) for d in (*xs[2:], *bs[2:])):
        return None
    if not isinstance(gn.args[4], int) or not isinstance(gn.args[3], float):
        return None
    split = parts[0].args[0]
    chain = [conv, split, *parts, *(sa[i] for i in (0, 3, 4)), ssm, ry, gn]
    order = {n: i for i, n in enumerate(conv.graph.nodes)}
    chain.sort(key=order.__getitem__)
    # known arguments, by position (fuse below reads them there)
    known = [ca[0], gn.args[1], sa[1], ca[1], ca[2], ca[3], ca[7], ca[5], ca[6], ca[8], ca[10],
             ca[11], sa[2], sa[5], sa[6], sa[7], gn.args[2], ca[4], sa[8]]
    consts = dict(dt_min=sa[13], dt_max=sa[14], eps=gn.args[3], group=gn.args[4], h=xs[2],
                  p=xs[3], g=bs[2], n=bs[3])
    return chain, known, consts


def _decay(g: fx.Node, reader: fx.Node):
    """g = mul(A, softplus_rows(add(a, dt_bias))) (a through identity casts): (A, a, dt_bias,
    the nodes)."""
    if not (_call(g, _aten.mul.Tensor) and _only(g, reader) and len(g.args) == 2):
        return None
    A, sp = g.args
    if not (_call(sp, softplus_rows) and _only(sp, g) and len(sp.args) == 1):
        return None
    add = sp.args[0]
    if not (_call(add, _aten.add.Tensor) and _only(add, sp) and len(add.args) == 2):
        return None
    a, dt_bias = add.args
    nodes = [g, sp, add]
    while isinstance(a, fx.Node) and is_identity(a) and _only(a, nodes[-1]):
        nodes.append(a)
        a = a.args[0]
    if not all(isinstance(x, fx.Node) for x in (A, a, dt_bias)):
        return None
    return A, a, dt_bias, nodes


def _match_gdn(gn: fx.Node, conv_fn, gdn_fn):
    if not (_call(gn, _gated_rms_norm_kernel) and len(gn.args) == 6 and gn.args[5] is True):
        return None
    gdn = gn.args[0]
    if not (_call(gdn, gdn_fn) and _only(gdn, gn)):
        return None
    ga = _args(gdn, _GDN_ARGS)
    if ga is None:
        return None
    chain = [gdn, gn]
    qk = []
    for x in (ga[0], ga[1]):
        if _call(x, _aten.repeat_interleave.self_int) and _only(x, gdn) and x.args[2] == 2:
            chain.append(x)
            x = x.args[0]
            reader = chain[-1]
        else:
            reader = gdn
        qk.append((x, reader))
    parts = [_reshaped(x, r) for x, r in (*qk, (ga[2], gdn))]
    if None in parts or len({id(p) for p in parts}) != 3:
        return None
    conv = parts[0].args[0].args[0] if _call(parts[0], operator.getitem) else None
    if not (_call(conv, conv_fn) and _split3(conv, parts)):
        return None
    ca = _args(conv, _CONV_ARGS)
    if ca is None or ca[9] != "silu":
        return None
    decay = _decay(ga[3], gdn)
    beta = ga[4]
    if decay is None or not (_call(beta, sigmoid_rows) and _only(beta, gdn)):
        return None
    A, a, dt_bias, decay_nodes = decay
    ks, vs = _shape(qk[1][0]), _shape(ga[2])
    if (ks is None or vs is None or not all(isinstance(d, int) for d in (*ks[2:], *vs[2:]))
            or not isinstance(ga[11], bool) or not isinstance(ga[12], float)
            or not isinstance(gn.args[4], int) or not isinstance(gn.args[3], float)):
        return None
    split = parts[0].args[0]
    chain += [conv, split, *parts, *(x for x, _ in qk), ga[2], *decay_nodes, beta]
    order = {n: i for i, n in enumerate(conv.graph.nodes)}
    chain = sorted(set(chain), key=order.__getitem__)
    known = [ca[0], beta.args[0], a, gn.args[1], ca[1], ca[2], ca[3], ca[7], ca[5], ca[6], ca[8],
             ca[10], ca[11], A, dt_bias, ga[5], gn.args[2], ca[4], ga[6]]
    consts = dict(l2norm=ga[11], scale=ga[12] if ga[12] > 0 else ks[3] ** -0.5, eps=gn.args[3],
                  group=gn.args[4], hk=ks[2], h=vs[2], dk=ks[3], dv=vs[3])
    return chain, known, consts


@register("fuse_recurrent_mixers", Stage.COMPILE, skip_if=_skip)
def fuse_recurrent_mixers(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    conv_fn = _kernel(_ops.cached_causal_conv1d.default)
    ssm_fn = _kernel(_ops.cached_ssm_scan.default)
    gdn_fn = _kernel(_ops.cached_gated_delta_rule.default)
    found = []
    for node in list(gm.graph.nodes):
        m = _match_mamba2(node, conv_fn, ssm_fn)
        if m is not None:
            found.append((m, _mamba2_fn, "mamba2_mixer"))
            continue
        m = _match_gdn(node, conv_fn, gdn_fn)
        if m is not None:
            found.append((m, _gdn_fn, "gdn_mixer"))
    if not found:
        return Done(0, "no recurrent mixer")
    if row_kernels._library() is None:
        return Skipped("row kernels unavailable")
    for (chain, known, consts), fn_of, name in found:
        _fuse(gm, chain, known, fn_of, consts, name)
    gm.graph.lint()
    gm.recompile()
    kinds = sorted({name for _, _, name in found})
    return Done(len(found), f"{len(found)} mixers ({', '.join(kinds)}) in one call each")
